"""`RemoteLoader`: the local `DataLoader`'s batches, pulled from feed servers over gRPC.

With equal arguments a `RemoteLoader` yields the batches the local `gdsload.DataLoader` would, in
the same order and with the same structure (a dict field -> tensor, plus "__key__"; a tuple when
`fields` is given), because the server runs that very loader for the requested slice.

Cursor and resumption: the loader owns its cursor (epoch, position), where position counts the
global positions consumed, as in the local loader's state. Each stream asks for "this rank's
batches from position p"; a batch counts only once its last chunk arrived. When a stream breaks,
the server restarts or a server refuses (a retryable status, `gdsload.service.status.RETRYABLE`),
the loader waits (exponential backoff with jitter), moves to the next address when it has several,
and asks again from the position after the last complete batch: nothing is lost or repeated. A
server whose copy of the data is corrupt (DATA_LOSS) is not asked again; each other address is,
once. The retry budget is time: `retry_timeout_s` (default 120 s, enough for a server restart)
without a batch, optionally also `max_retries` attempts; the error it ends with says how to resume.
`state_dict()` / `load_state_dict()` are the local loader's (same format, checked by
`gdsload.plan.plan.Plan`), so a state saved by either loader resumes in the other.

Lifetime: the receiver thread holds the connection state (`_Link`) and its own queue, never the
loader nor the epoch iterator, and the loader refers to its epoch weakly. A loader or iterator
dropped mid-epoch is therefore collected, and its finalizer cancels the stream at once (a thread
that kept the loader alive held the server's stream slot for `stream_deadline_s`).

Prefetch: one receiver thread per iteration pulls and assembles up to `prefetch` batches ahead;
the cursor (and so `state_dict()`) moves only when a batch is handed to the caller. Batches are the
caller's to keep (fresh memory per batch).

Deadlines: unary calls have `deadline_s`; a stream has `stream_deadline_s` as its gRPC deadline
(it is then resumed like a broken one) and is cancelled and resumed when no message arrives for
`deadline_s`.

Processes: a loader pickles to its configuration and cursor (`gdsload.host.forksafe`): channels,
credentials, locks and the receiver thread are made afresh in the process that iterates it, and
a forked child finds the parent's by a pid check and leaves them alone. So a loader built (and
used) in a parent works in `torch.utils.data.DataLoader` workers under fork, spawn and
forkserver, continuing from the parent's cursor. grpc is imported here, not by `import gdsload`.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gdsload.host.dist import dist_rank_world
from gdsload.errors import GdsloadError, require
from gdsload.host.forksafe import ProcessLocal

require("grpc", extra="serve", purpose="the remote feed (RemoteLoader)")

import grpc

from gdsload.frontend.fields import parse_columns
from gdsload.frontend.usercode import MapStage
from gdsload.frontend.output import as_output, default_output, torch_or_none
from gdsload.dataset.mix import Mix
from gdsload.frontend.cursor import PlanCursor
from gdsload.service import mixwire, status, wire
from gdsload.service.auth import metadata
from gdsload.service.config import Keepalive, MiB, channel_options, read_pem
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

__all__ = ["RemoteLoader"]


class _FeedStub(pb_grpc.FeedStub):
    """The generated stub, but StreamBatches yields `(BatchChunk without data, data view)` from
    `wire.split_chunk`: protobuf would copy every chunk's data twice."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.StreamBatches = channel.unary_stream(
            "/gdsload.v1.Feed/StreamBatches", request_serializer=pb.BatchRequest.SerializeToString,
            response_deserializer=wire.split_chunk, _registered_method=True)


class _Channels:
    """One channel per address, in the process that made this object (`_Link` makes one per
    process: the parent's channels, threads and sockets belong to the parent). `tls`: the PEM
    bytes (root certificates, private key, certificate chain) or None; the credentials are made
    here, since grpc's cannot be pickled."""

    def __init__(self, tls: tuple[bytes | None, bytes | None, bytes | None] | None, options: list[tuple[str, Any]]):
        self._credentials = None
        if tls is not None:
            root, key, chain = tls
            self._credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                                             certificate_chain=chain)
        self._options = options
        self._stubs: dict[str, tuple[grpc.Channel, _FeedStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> _FeedStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                if self._credentials is not None:
                    channel = grpc.secure_channel(address, self._credentials, options=self._options)
                else:
                    channel = grpc.insecure_channel(address, options=self._options)
                entry = (channel, _FeedStub(channel))
                self._stubs[address] = entry
            return entry[1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs = {}


class RemoteLoader(ProcessLocal, PlanCursor):
    """Batches of a dataset served by `gdsload serve`, as the local `DataLoader` would make them.

    `address`: "HOST:PORT" or a list of them; rank r starts on address ``r % len`` and fails
    over to the next one. `dataset`: the served name (`ListDatasets`). `batch_size`, `shuffle`,
    `drop_last`, `seed`, `rank`, `world_size` (default: from `torch.distributed` when initialised,
    else 0 and 1), `shuffle_window`, `decode` (decode images on the server; False: encoded
    bytes), `transform` (an `ImageTransform`; None: the default training transform, as locally),
    `fields`, `on_error`, `output` ("torch" when torch is installed, else "numpy") mean what
    they mean for `DataLoader`. `device`: where torch tensors go ("cpu", "cuda"; default cuda
    when torch sees a GPU, as locally).

    Connection: `token` (bearer token), `tls` (use TLS with the system roots), `tls_ca` (CA
    bundle, PEM bytes or path; implies TLS), `tls_cert`/`tls_key` (client certificate for mutual
    TLS), `tls_server_name` (override the name checked in the server certificate). `deadline_s`:
    deadline of unary calls, and the longest wait for the next message of a stream.
    `stream_deadline_s`: gRPC deadline of one stream (then it is resumed). `retry_timeout_s`: how
    long the loader keeps retrying (reconnecting, failing over) without getting a batch or an
    answer before it gives up with `RemoteError` (default 120 s: rides out a server restart);
    `max_retries`: also give up after this many consecutive failed attempts (None: no count, only
    the time). `backoff_s`, `max_backoff_s`: first and largest wait between attempts. After giving
    up, `state_dict()` is at the last batch handed out: `load_state_dict()` it into this or a new
    loader to resume. `prefetch`: batches received ahead.
    `batches_per_stream`: end each stream after this many batches and open the next one (0: one
    stream per epoch); short streams let a list of servers rebalance. `max_message_bytes`: the
    largest message accepted (the server chunks below it).

    Training transforms are random: remote and local batches are the same crops only when both
    decode the same batches in the same sequence; evaluation transforms are deterministic.

    Processes: pickles to its configuration and cursor; a copy or a forked child connects afresh
    and continues where the loader stood (`state_dict()`).
    """

    _PROCESS_LOCAL = ("_active", "_stats")

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        dataset: str | Mix,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = 4,
        decode: bool = True,
        transform: Any = None,
        fields: Sequence[str] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        output: Literal["torch", "numpy", None] = None,
        device: str | None = None,
        token: str | None = None,
        tls: bool = False,
        tls_ca: bytes | str | Path | None = None,
        tls_cert: bytes | str | Path | None = None,
        tls_key: bytes | str | Path | None = None,
        tls_server_name: str | None = None,
        deadline_s: float = 30.0,
        stream_deadline_s: float = 3600.0,
        retry_timeout_s: float = 120.0,
        max_retries: int | None = None,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        prefetch: int = 2,
        batches_per_stream: int = 0,
        max_message_bytes: int = 64 * MiB,
        keepalive: Keepalive | None = None,
        map: Any = None,
        collate_fn: Any = None,
    ):
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise GdsloadError(f"address must be 'HOST:PORT' or a non-empty list of them, got {address!r}")
        if not isinstance(dataset, Mix) and (not isinstance(dataset, str) or not dataset):
            raise GdsloadError(f"dataset must be the served dataset's name (or a gdsload.Mix of "
                               f"served names), got {dataset!r}")
        if on_error not in ("raise", "skip"):
            raise GdsloadError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        if output not in ("torch", "numpy", None):
            raise GdsloadError(f"output must be 'torch', 'numpy' or None, not {output!r}")
        for name, value in (("deadline_s", deadline_s), ("stream_deadline_s", stream_deadline_s),
                            ("retry_timeout_s", retry_timeout_s), ("backoff_s", backoff_s),
                            ("max_backoff_s", max_backoff_s)):
            if not value > 0:
                raise GdsloadError(f"{name} must be > 0 seconds, got {value!r}")
        if (max_retries is not None and max_retries < 0) or prefetch < 1 or batches_per_stream < 0:
            raise GdsloadError(f"max_retries (or None) and batches_per_stream must be >= 0 and prefetch >= 1, "
                               f"got {max_retries}, {batches_per_stream} and {prefetch}")
        dist = dist_rank_world()
        self.rank = rank if rank is not None else (dist[0] if dist else 0)
        self.world_size = world_size if world_size is not None else (dist[1] if dist else 1)
        self.addresses = addresses
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.shuffle_window = shuffle_window
        self.decode = decode
        from gdsload.frontend.options import split_transforms

        self.transform = transform
        image, media = split_transforms(transform) if decode else (None, ())
        if decode and image is None:
            image = wire.ImageTransform()
        self._spec = wire.transform_to_spec(image) if decode else None
        self._media = []  # video/audio decoded on the server (gdsload.service.mediawire)
        if media:
            from gdsload.service import mediawire

            self._media = mediawire.to_specs(media)
        self.tuple_fields = list(fields) if fields is not None else None
        # map / collate_fn run here on the client, in the consumer's thread (gdsload.frontend.usercode)
        self._stage = MapStage.create(map, collate_fn, "thread")
        self._request_fields = [f for f in (fields or []) if f not in (wire.KEY, wire.SOURCE)]
        self.on_error = on_error
        self.output = default_output(output)
        if device is None:
            torch = torch_or_none()
            device = "cuda" if self.output == "torch" and torch is not None and torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") or (device == "cuda" and self.output != "torch"):
            raise GdsloadError(f"device must be 'cpu', or 'cuda' with torch output, not {device!r}")
        self.device = device
        self.prefetch = int(prefetch)
        self.batches_per_stream = int(batches_per_stream)
        self.max_message_bytes = int(max_message_bytes)
        pems = None  # PEM bytes, not grpc's credentials: those do not pickle (see _Channels)
        if tls or tls_ca or tls_cert or tls_key:
            if bool(tls_cert) != bool(tls_key):
                raise GdsloadError("mutual TLS needs both tls_cert and tls_key")
            pems = (read_pem(tls_ca, "tls_ca") if tls_ca else None, read_pem(tls_key, "tls_key") if tls_key else None,
                    read_pem(tls_cert, "tls_cert") if tls_cert else None)
        options: list[tuple[str, Any]] = channel_options(self.max_message_bytes, keepalive or Keepalive())
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._link = _Link(
            addresses, self.rank % len(addresses) if isinstance(self.rank, int) and self.rank >= 0 else 0,
            (pems, options), metadata(token), dataset=dataset, deadline_s=float(deadline_s),
            stream_deadline_s=float(stream_deadline_s), retry_timeout_s=float(retry_timeout_s),
            max_retries=None if max_retries is None else int(max_retries), backoff_s=float(backoff_s),
            max_backoff_s=float(max_backoff_s))
        self._plan = None
        self._info: pb.DatasetInfo | None = None
        self._epoch = 0
        self._position = 0
        self._start_process()

    def _init_process_local(self) -> None:
        self._active: weakref.ref[_RemoteEpoch] | None = None  # weak: see "Lifetime" above
        self._stats: dict[str, Any] = {"batches": 0, "bytes": 0, "wait_s": 0.0}

    def _enter_process(self) -> None:
        """In a forked child, leave the parent's epoch, channels and locks alone and start afresh."""
        self._check_process()
        self._link._check_process()

    # -- plan, from the server's manifest ---------------------------------------------------------
    @property
    def plan(self):
        """The `gdsload.plan.plan.Plan` of this rank (asks the server for the dataset on first use)."""
        if self._plan is None and isinstance(self.dataset, Mix):
            from gdsload.plan.mix import MixPlan

            def info(name: str) -> pb.DatasetInfo:
                return self._unary("ListDatasets", pb.ListDatasetsRequest(name=name)).datasets[0]

            spec = mixwire.resolve(self.dataset, info, self._request_fields)
            self._plan = MixPlan(
                dataset_id=spec.mix_id, shard_sizes=spec.shard_sizes, mix=spec,
                batch_size=self.batch_size, world_size=self.world_size, rank=self.rank, seed=self.seed,
                shuffle=self.shuffle, window=self.shuffle_window, drop_last=self.drop_last,
            )
        if self._plan is None:
            from gdsload.plan.plan import Plan

            info = self.dataset_info()
            if self._request_fields:
                unknown = [f for f in self._request_fields if f not in info.fields]
                if unknown:
                    raise GdsloadError(f"fields {unknown} are not in dataset {self.dataset!r} "
                                       f"(it has {sorted(info.fields)})")
            self._plan = Plan(
                dataset_id=info.dataset_id, shard_sizes=tuple(info.shard_sizes),
                batch_size=self.batch_size, world_size=self.world_size, rank=self.rank, seed=self.seed,
                shuffle=self.shuffle, window=self.shuffle_window, drop_last=self.drop_last,
            )
        return self._plan

    def dataset_info(self) -> pb.DatasetInfo:
        """The server's `DatasetInfo` of this dataset (name, id, shard sizes, fields, manifest)."""
        if self._info is None:
            resp = self._unary("ListDatasets", pb.ListDatasetsRequest(name=self.dataset))
            if len(resp.datasets) != 1:
                raise GdsloadError(f"the server answered {len(resp.datasets)} datasets for {self.dataset!r}")
            self._info = resp.datasets[0]
        return self._info

    def server_info(self) -> pb.ServerInfo:
        return self._unary("GetServerInfo", pb.GetServerInfoRequest())

    # -- torch-like surface ---------------------------------------------------------------------
    # len(), set_epoch(), epoch, state_dict(): from PlanCursor

    def load_state_dict(self, state: Any) -> None:
        """As `DataLoader.load_state_dict`; an epoch the feed cannot carry (BatchRequest.epoch is
        a uint64) is refused here as a `StateError`, not later by protobuf."""
        from gdsload.plan.plan import StateError

        epoch, position = self.plan.resume(state)
        if epoch >= 1 << 64:
            raise StateError(f"state field 'epoch' is {epoch}, over the feed's limit of 2**64 - 1 "
                             "(BatchRequest.epoch is a uint64)")
        self._epoch, self._position = epoch, position

    def _active_epoch(self) -> _RemoteEpoch | None:
        return self._active() if self._active is not None else None

    def __iter__(self) -> _RemoteEpoch:
        self._enter_process()
        active = self._active_epoch()
        if active is not None:
            active.close()
        ep = _RemoteEpoch(self, self._epoch, self._position)
        self._active = weakref.ref(ep)
        return ep

    def stats(self) -> dict[str, Any]:
        """batches, bytes (batch bodies), reconnects, wait_s (time the caller waited), address."""
        return dict(self._stats, reconnects=self._link.reconnects, address=self._link.address())

    def close(self) -> None:
        self._enter_process()
        active = self._active_epoch()
        if active is not None:
            active.close()
        self._active = None
        self._link.channels.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"gdsload.RemoteLoader({self.addresses!r}, dataset={self.dataset!r}, "
                f"batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size})")

    # -- calls ------------------------------------------------------------------------------------
    def _unary(self, method: str, request: Any) -> Any:
        self._enter_process()
        return self._link.unary(method, request)

    def _request(self, epoch: int, position: int) -> pb.BatchRequest:
        plan = self.plan
        mixed = isinstance(self.dataset, Mix)
        return pb.BatchRequest(
            dataset="" if mixed else self.dataset, dataset_id=plan.dataset_id,
            mix=mixwire.to_pb(self.dataset, plan.mix) if mixed else None, seed=plan.seed, epoch=epoch,
            shuffle=plan.shuffle, shuffle_window=plan.window, drop_last=plan.drop_last,
            batch_size=plan.batch_size, rank=plan.rank, world_size=plan.world_size,
            start_position=position,
            payload=pb.PAYLOAD_DECODED if self.decode else pb.PAYLOAD_RAW,
            transform=self._spec, fields=self._request_fields, media=self._media,
            on_error=pb.ON_ERROR_SKIP if self.on_error == "skip" else pb.ON_ERROR_RAISE,
            max_chunk_bytes=self.max_message_bytes, max_batches=self.batches_per_stream,
        )

    def _convert(self, batch: dict[str, Any]) -> Any:
        batch = parse_columns(batch, decode=self.decode)  # text, json, ragged .npy: as locally
        if self._stage is not None:
            names = [f"{k}" for k in batch[wire.KEY]]
            return self._stage.start(0).run(batch, names, self._to_output)
        if self.output == "torch":
            for k, v in batch.items():
                if isinstance(v, np.ndarray):
                    batch[k] = self._to_output(v)
                elif isinstance(v, list) and v and isinstance(v[0], np.ndarray):  # a ragged .npy field
                    batch[k] = [self._to_output(a) for a in v]
        if self.tuple_fields is not None:
            return tuple(batch[f] for f in self.tuple_fields)
        return batch

    def _to_output(self, arr: np.ndarray) -> Any:
        return as_output(arr, self.output, self.device)  # NumPy output: `arr` itself (device is "cpu")


class _Retry(Exception):
    """A stream ended early without an error status (e.g. a draining server)."""


class _Link(ProcessLocal):
    """How a loader reaches its servers, shared by the loader and its receiver threads: channels,
    addresses and the one in use, call metadata, deadlines and the retry policy.

    It refers to no loader and no epoch, so a thread holding it keeps neither alive. Its
    channels, lock and random generator are per process (`ProcessLocal`; the loader checks).
    """

    _PROCESS_LOCAL = ("channels", "_lock", "_rng")

    def __init__(self, addresses: list[str], index: int, channel_args: tuple, call_metadata: Any, *,
                 dataset: str, deadline_s: float, stream_deadline_s: float, retry_timeout_s: float,
                 max_retries: int | None, backoff_s: float, max_backoff_s: float):
        self.addresses = addresses
        self.index = index
        self.channel_args = channel_args
        self.metadata = call_metadata
        self.dataset = dataset
        self.deadline_s = deadline_s
        self.stream_deadline_s = stream_deadline_s
        self.retry_timeout_s = retry_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.reconnects = 0
        self._start_process()

    def _init_process_local(self) -> None:
        self.channels = _Channels(*self.channel_args)
        self._lock = threading.Lock()
        self._rng = random.Random()

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
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failures - 1))
        with self._lock:
            return delay * (0.5 + 0.5 * self._rng.random())

    def gave_up(self, attempts: _Attempts, last_error: str, address: str, *, resume: bool) -> status.RemoteError:
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
        attempts = _Attempts(self)
        corrupt: set[str] = set()
        while True:
            address = self.address()
            try:
                call = getattr(self.channels.stub(address), method)
                return call(request, timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as err:
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


class _Attempts:
    """A run of failed attempts with nothing received in between: the retry budget. It is spent
    once `retry_timeout_s` passed since the first failure, or (when set) after `max_retries`
    retries; `delay()` never sleeps past the budget's end."""

    def __init__(self, link: _Link):
        self.link = link
        self.failures = 0
        self.since = 0.0

    def fail(self) -> None:
        if self.failures == 0:
            self.since = time.monotonic()
        self.failures += 1

    def reset(self) -> None:
        self.failures = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.since if self.failures else 0.0

    def spent(self) -> bool:
        L = self.link
        return bool(self.failures) and (self.elapsed() >= L.retry_timeout_s
                                        or (L.max_retries is not None and self.failures > L.max_retries))

    def delay(self) -> float:
        return max(0.0, min(self.link.backoff(self.failures), self.link.retry_timeout_s - self.elapsed()))


class _Receiver:
    """The receiving half of one epoch, run by its thread: streams from the link's servers,
    assembles batches and queues them (at most `prefetch`), resuming after each failure from the
    position after the last complete batch.

    It holds the link, a request template and its queue, never the loader nor the epoch
    iterator: those stay collectable while the thread waits, and their finalizer calls `cancel`.
    """

    def __init__(self, link: _Link, template: pb.BatchRequest, *, epoch: int, position: int,
                 global_batch: int, end: int, prefetch: int):
        self.link = link
        self.template = template
        self.epoch = epoch
        self.G = global_batch
        self.end = end
        self.next_request = position
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.pid = os.getpid()
        self.stop = threading.Event()
        self._call_lock = threading.Lock()
        self._call: Any = None
        self._waiting_since: float | None = None
        self._idle_cancelled = False

    def cancel(self) -> None:
        """Stop the thread and cancel the call in flight; never blocks (safe in a finalizer)."""
        if os.getpid() != self.pid:  # a forked child: the thread, the call and their locks are the parent's
            return
        self.stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def watchdog(self) -> None:
        """Cancel a stream that sent nothing for `deadline_s` (it is then resumed)."""
        since = self._waiting_since
        if since is not None and time.monotonic() - since > self.link.deadline_s:
            with self._call_lock:
                if self._call is not None and self._waiting_since is not None:
                    self._idle_cancelled = True
                    self._call.cancel()

    def _put(self, item: tuple) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _request(self) -> pb.BatchRequest:
        req = pb.BatchRequest()
        req.CopyFrom(self.template)
        req.start_position = self.next_request
        return req

    def run(self) -> None:
        link = self.link
        attempts = _Attempts(link)
        corrupt: set[str] = set()  # addresses that answered DATA_LOSS since the last batch
        last_error = "no attempt"
        try:
            while self.next_request < self.end and not self.stop.is_set():
                address = link.address()
                progressed = False
                try:
                    call = link.channels.stub(address).StreamBatches(
                        self._request(), timeout=link.stream_deadline_s, metadata=link.metadata)
                    with self._call_lock:
                        self._call = call
                    if self.stop.is_set():
                        call.cancel()
                        return
                    asm = wire.BatchAssembler()
                    it = iter(call)
                    while True:
                        self._waiting_since = time.monotonic()
                        try:
                            chunk, data = next(it)
                        except StopIteration:
                            break
                        finally:
                            self._waiting_since = None
                        batch = asm.add(chunk, data)
                        if batch is None:
                            continue
                        expected = self.next_request + self.G
                        if chunk.epoch != self.epoch or chunk.position != expected:
                            raise wire.ProtocolError(
                                f"got the batch of epoch {chunk.epoch} ending at position {chunk.position}, "
                                f"expected epoch {self.epoch} position {expected}")
                        if not self._put(("batch", batch, expected, wire.body_nbytes(batch))):
                            return
                        self.next_request = expected
                        progressed = True
                        attempts.reset()
                        corrupt.clear()
                    if self.next_request < self.end and not progressed:
                        raise _Retry(f"{address} ended the stream without a batch (draining?)")
                except grpc.RpcError as err:
                    if self.stop.is_set():
                        return
                    idle = self._idle_cancelled
                    self._idle_cancelled = False
                    if not idle and status.is_elsewhere(err):
                        # This server's copy is corrupt: ask each other address once, not this one again.
                        corrupt.add(address)
                        if corrupt.issuperset(link.addresses):
                            self._put(("error", link.corrupt_everywhere(err, address)))
                            return
                        link.failover(address)
                        continue
                    if not idle and not status.is_retryable(err):
                        self._put(("error", status.from_rpc_error(err, address)))
                        return
                    last_error = (f"no message for {link.deadline_s} s from {address}" if idle
                                  else str(status.from_rpc_error(err, address)))
                    attempts.fail()
                except (_Retry, wire.ProtocolError) as exc:
                    last_error = str(exc)
                    attempts.fail()
                finally:
                    with self._call_lock:
                        self._call = None
                if attempts.failures and not progressed:
                    if attempts.spent():
                        self._put(("error", link.gave_up(attempts, last_error, address, resume=True)))
                        return
                    link.failover(address)
                    if self.stop.wait(attempts.delay()):
                        return
                elif attempts.failures:  # broke after some batches: retry at once, same address
                    attempts.reset()
                    link.reconnect()
            if not self.stop.is_set():
                self._put(("end",))
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            self._put(("error", exc))


class _RemoteEpoch:
    """One pass, the consumer's side: `__next__` hands out what the receiver thread queued and
    moves the loader's cursor. Dropping it (or its loader) cancels the receiver's stream."""

    def __init__(self, loader: RemoteLoader, epoch: int, position: int):
        self.loader = loader
        self.epoch = epoch
        plan = loader.plan
        self.receiver = _Receiver(loader._link, loader._request(epoch, position), epoch=epoch,
                                  position=position, global_batch=plan.global_batch,
                                  end=plan.end_position, prefetch=loader.prefetch)
        self.pid = os.getpid()  # the receiver thread and its call exist in this process only
        self._successor: _RemoteEpoch | None = None
        self._done = False
        self._finalizer = weakref.finalize(self, self.receiver.cancel)
        self.thread = threading.Thread(target=self.receiver.run, name="gdsload-remote", daemon=True)
        self.thread.start()

    def __iter__(self) -> _RemoteEpoch:
        return self

    def __next__(self) -> Any:
        if self.pid != os.getpid():
            return self._next_in_forked_child()
        if self._done:
            raise StopIteration
        L = self.loader
        t0 = time.perf_counter()
        while True:
            try:
                item = self.receiver.queue.get(timeout=0.25)
                break
            except queue.Empty:
                self.receiver.watchdog()
                if not self.thread.is_alive() and self.receiver.queue.empty():
                    self.close()
                    raise status.RemoteError("the receiver thread ended without a result",
                                             code="INTERNAL") from None
        L._stats["wait_s"] += time.perf_counter() - t0
        if item[0] == "batch":
            _, batch, position, nbytes = item
            L._position = position
            L._stats["batches"] += 1
            L._stats["bytes"] += nbytes
            return L._convert(batch)
        if item[0] == "end":
            self._finish()
            raise StopIteration
        self.close()
        raise item[1]

    def _next_in_forked_child(self) -> Any:
        """The parent's iterator, used in a forked child: its receiver thread is not here and its
        queue's lock may be held, so continue with a new iteration of the child's copy of the
        loader, which starts at the loader's cursor (the batch after the last one handed out)."""
        if self._successor is None:
            if self._done:
                raise StopIteration
            self._done = True
            self._successor = iter(self.loader)
        return next(self._successor)

    def __reduce__(self):
        raise TypeError("a gdsload.RemoteLoader iterator cannot be pickled: pickle the loader itself, whose copy "
                        "continues from the loader's state_dict()")

    def _finish(self) -> None:
        self.close()
        self.loader._epoch = self.epoch + 1
        self.loader._position = 0

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self._finalizer()  # cancels the call (the parent's is left alone in a forked child)
        if os.getpid() == self.pid and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        if self.loader._active_epoch() is self:
            self.loader._active = None
