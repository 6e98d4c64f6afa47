"""`RemoteLoader`: the local `DataLoader`'s batches, pulled from feed servers over gRPC.

With equal arguments a `RemoteLoader` yields the batches the local `gdsload.DataLoader` would, in
the same order and with the same structure (a dict field -> tensor, plus "__key__"; a tuple when
`fields` is given), because the server runs that very loader for the requested slice.

Cursor and resumption: the loader owns its cursor (epoch, position), where position counts the
global positions consumed, as in the local loader's state. Each stream asks for "this rank's
batches from position p"; a batch counts only once its last chunk arrived. When a stream breaks,
the server restarts or a server refuses (a retryable status, `gdsload.service.protocol.status.RETRYABLE`),
the loader waits (exponential backoff with jitter), moves to the next address when it has several,
and asks again from the position after the last complete batch: nothing is lost or repeated. A
server whose copy of the data is corrupt (DATA_LOSS) is not asked again; each other address is,
once. The retry budget is time: `retry_timeout_s` (default 120 s, enough for a server restart)
without a batch, optionally also `max_retries` attempts; the error it ends with says how to resume.
`state_dict()` / `load_state_dict()` are the local loader's (same format, checked by
`gdsload.plan.plan.Plan`), so a state saved by either loader resumes in the other. The cursor is
the local loader's `gdsload.frontend.cursor.Cursor`, with its rules: an iteration registers as its
live pass, `load_state_dict()` or a `set_epoch()` that changes the epoch while it is live cancels
its stream first, and `state_dict()` says what the next `iter()` will do.

Modules: this one is the facade (arguments, source and plan, cursor); `epoch.py` is the pass the
training loop holds, over a receiver (`single.py`, or `stripe/` with several servers); `link.py`
holds the channels and the retry policy; `output.py` the conversion (see the package docstring).

Lifetime: the receiver threads hold the connection state (`Link`) and their own queue, never the
loader nor the epoch iterator, and the loader's cursor refers to its epoch weakly. A loader or iterator
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

import functools
import numbers
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gdsload.errors import ConfigError, GdsloadError, RemoteError, require
from gdsload.host.forksafe import ProcessLocal
from gdsload.host.malloc import keep_large_blocks

require("grpc", extra="serve", purpose="the remote feed (RemoteLoader)")

from gdsload.frontend.cursor import Cursor, PlanCursor
from gdsload.frontend.options import LoaderOptions
from gdsload.frontend.usercode import MapStage
from gdsload.plan.plan import DEFAULT_ORDER, ORDERS, PlanError
from gdsload.service.client.epoch import RemoteEpoch, Tally
from gdsload.service.client.link import Link, check_addresses, is_dns
from gdsload.service.client.options import Connection, Pem, RetryPolicy, group
from gdsload.service.client.output import OutputConverter
from gdsload.service.client.receive import Receiver
from gdsload.service.client.single import SingleReceiver
from gdsload.service.client.source import remote_source
from gdsload.service.client.stripe.policy import StripePolicy
from gdsload.service.client.stripe.receiver import StripedReceiver
from gdsload.service.protocol import imagewire, wire
from gdsload.service.protocol.config import Keepalive, MiB
from gdsload.service.protocol import request as request_rules
from gdsload.v1 import feed_pb2 as pb

if TYPE_CHECKING:
    from gdsload.dataset.mix import Mix

__all__ = ["RemoteLoader"]


class RemoteLoader(ProcessLocal, PlanCursor):
    """Batches of a dataset served by `gdsload serve`, as the local `DataLoader` would make them.

    `address`: "HOST:PORT", "[IPv6]:PORT", "unix:PATH" (a server on this host:
    `gdsload serve --listen unix:PATH`), "dns:///NAME:PORT" (every address NAME resolves to, e.g.
    a Kubernetes headless service; resolved by gdsload every `resolve_interval_s`, TLS checks
    NAME), or a list of them. With several addresses or a `dns:///` name the loader stripes
    (`stripe`, default on then): it pulls its batches from every healthy server at once, in
    blocks of `stripe_batches` consecutive batches (block b on the b-th server, stolen by an idle
    one), at most `server_window` requests in flight per server, and hands them out in plan order
    (see `gdsload.service.client.stripe`); a request silent for `stall_timeout_s` is
    cancelled and asked of another server. With one plain address, or `stripe=False`, it reads
    from one server at a time: rank r starts on address ``r % len`` and fails over to the next
    one. `dataset`: the served name (`ListDatasets`). `version`: read the dataset as it was at
    that manifest version, as `gdsload.Dataset(path, version=K)` (default: the version served when
    the loader first asks); an append on the server never changes the version a loader reads, and
    a state from an earlier version resumes with `version=K` (the requests name the version by
    its dataset id; `gdsload.service.server.catalog`). `batch_size`, `shuffle`,
    `drop_last`, `seed`, `rank`, `world_size` (default: from `torch.distributed` when initialised,
    else 0 and 1), `shuffle_window`, `order` (the order version; default `DEFAULT_ORDER`, as the
    local loader's, so both give the same batches; the requests name it in `BatchRequest.dataset_id`
    and the loader first checks that its server serves it, `ServerInfo.orders`, else raises a
    `RemoteError` saying what to do; `order=1` resumes states saved before order versions and
    reads servers older than them), `decode` (decode images on the server; False: encoded
    bytes), `transform` (an `ImageTransform`; None: the default training transform, as locally),
    `fields`, `on_error`, `output` ("torch" when torch is installed, else "numpy") mean what
    they mean for `DataLoader`. `device`: where torch tensors go ("cpu", "cuda"; default cuda
    when torch sees a GPU, as locally).

    Option groups: the connection's (`connection`), the retry policy's (`retry`) and striping's
    (`striping`) options may be given as one frozen object each (`gdsload.service.client.options`:
    `Connection`, `RetryPolicy`; `gdsload.service.client.stripe.StripePolicy`) or as the keywords
    below; one option in both places is refused. The loader holds them as `loader.connection`,
    `loader.retry` and `loader.striping`.

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
    loader to resume. `prefetch`: batches received ahead. `prefetch_next_epoch`: in the last
    steps of an epoch (about twice the time a pass took to get its first batch, at the loop's
    pace) the next epoch's pass is opened, so a loop that goes on to it (the cursor moved there:
    `iter()` again, with or without `set_epoch` of that epoch) finds its first batches on the way
    instead of waiting for every server to set up a new stream (bench/priority_bench.py: ~0.35 s
    at a twentieth of a core, a tenth of a raw epoch). Its batches are held until then (up to
    `prefetch` and the striping window, as a pass's); a loader that does not go on (another epoch
    or state loaded, a `break`) cancels it at its next `iter()`, `close()` or collection, and one
    not taken over within `receive.AHEAD_IDLE_S` (10 s) of waiting cancels itself (a validation
    loop ran meanwhile: the servers hold no stream for it). Off by default, as PyTorch's
    DataLoader, which starts each pass at its `iter()`: a loader read for one epoch (inference, a
    pass, validation) would make a window of batches on every server for nothing; turn it on for
    a training loop over several epochs.
    `batches_per_stream`: end each stream after this many batches and open the next one (0: one
    stream per epoch); short streams let a list of servers rebalance. `max_message_bytes`: the
    largest message accepted (the server chunks below it). `bulk`: take the batches' bytes on the
    server's side connection when it offers one (a plain socket beside the call, a third of the CPU
    per byte of gRPC's; never with TLS; see `gdsload.service.server.bulk`); False: only inside gRPC.

    Training transforms are random: remote and local batches are the same crops only when both
    decode the same batches in the same sequence; evaluation transforms are deterministic.

    Sharing: `share` (a name, e.g. "sweep-17"; None: no sharing) puts this loader's streams in a
    share group on each server: loaders with the same dataset, seed, epoch, order, batch layout,
    rank, world size, payload, transform and fields, the same share name and the same credentials
    get the batches of one producer there, read and decoded once and sent to each. Every loader
    still gets exactly its own batches, in its order (the same as without `share`), and never
    waits for another: one that falls behind (paused, slower, started later, resumed from an older
    state) is served from its own cursor by a producer of its own. Random crops and flips are
    then the same for every loader of the group: right for sweeps and ablations, wrong for
    ensembles that want independent augmentation (give those no share name). `stats()` counts
    the batches that came as a copy of another loader's (`shared_batches`). See
    `gdsload.service.server.share`.

    Priorities (issue 49): `priority` (an int, default 0, higher first) is this loader's job's
    priority on every server; a server makes the next batch of a higher priority before any lower
    one's and shares a priority's time equally among its jobs (one loader, all its streams on all
    servers, is one job: `job`, a random id unless given; give the ranks of one training one id to
    make them one job). A server with tokens refuses a priority over the token's limit
    (PERMISSION_DENIED naming it); one without tokens trusts it. While a server holds this
    loader's stream back for higher work, the stream is only slower: its batches still come in
    plan order, and `stats()["servers"][address]` says so (`state` "paused", `pauses`,
    `paused_s`, `paused_reason`, `paused_at`); a paused stream is neither failed over, nor hedged,
    nor timed out (`retry_timeout_s`). See docs/feed.md, "Jobs and priorities".

    Processes: pickles to its configuration and cursor; a copy or a forked child connects afresh
    and continues where the loader stood (`state_dict()`).
    """

    _PROCESS_LOCAL = ("_tally", "_ahead")

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        dataset: str | Mix,
        version: int | None = None,
        # the local loader's options (gdsload.frontend.options.LoaderOptions)
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_window: int = 4,
        order: int = DEFAULT_ORDER,
        decode: bool = True,
        transform: Any = None,
        fields: Sequence[str] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        output: Literal["torch", "numpy", None] = None,
        device: str | None = None,
        map: Any = None,
        collate_fn: Any = None,
        share: str | None = None,
        priority: int = 0,
        job: str | None = None,
        prefetch: int = 2,
        prefetch_next_epoch: bool = False,
        batches_per_stream: int = 0,
        stripe: bool | None = None,
        # option groups, as objects or as the keywords of their fields (gdsload.service.client.options)
        connection: Connection | None = None,
        token: str | None = None, tls: bool = False, tls_ca: Pem = None, tls_cert: Pem = None, tls_key: Pem = None,
        tls_server_name: str | None = None, deadline_s: float = 30.0, stream_deadline_s: float = 3600.0,
        max_message_bytes: int = 64 * MiB, keepalive: Keepalive | None = None, bulk: bool = True,
        retry: RetryPolicy | None = None,
        retry_timeout_s: float = 120.0, max_retries: int | None = None, backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        striping: StripePolicy | None = None,
        stripe_batches: int = 4, server_window: int = 2, stall_timeout_s: float = 5.0, resolve_interval_s: float = 5.0,
    ):
        given = dict(locals())
        self.addresses = addresses = check_addresses(address)
        self.striped = bool(stripe) if stripe is not None else len(addresses) > 1 or any(is_dns(a) for a in addresses)
        self.striping = group(StripePolicy, striping, given, "striping")
        self.retry = group(RetryPolicy, retry, given, "retry")
        self.connection = group(Connection, connection, given, "connection")
        self.dataset = dataset
        remote_source(dataset, None, version=version)  # refuses what is not a served name or a Mix of them
        # the options a local DataLoader takes too: validated and resolved in one place (the
        # default device differs on purpose: see gdsload.frontend.options)
        self.options = opts = LoaderOptions.create(
            remote=True, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank,
            world_size=world_size, shuffle_window=shuffle_window, decode=decode, transform=transform, fields=fields,
            on_error=on_error, output=output, device=device, share=share)
        if prefetch < 1 or batches_per_stream < 0:
            raise GdsloadError(f"batches_per_stream must be >= 0 and prefetch >= 1, got {batches_per_stream} and "
                               f"{prefetch}")
        self.prefetch, self.batches_per_stream = int(prefetch), int(batches_per_stream)
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self.priority, self.job = check_priority(priority, job)
        self._parts = RequestParts.of(opts, fields, self.connection.max_message_bytes, self.batches_per_stream,
                                      priority=self.priority, job=self.job)
        # map / collate_fn run here on the client, in the consumer's thread (gdsload.frontend.usercode)
        self._output = OutputConverter(decode=opts.decode, output=opts.output, device=opts.device,
                                       tuple_fields=opts.tuple_fields, stage=MapStage.create(map, collate_fn, "thread"))
        first = opts.rank % len(addresses) if opts.rank >= 0 else 0  # rank r starts on address r % len
        self._link = Link(addresses, first, self.connection, self.retry, dataset=dataset, resolve_names=self.striped)
        self.source = remote_source(dataset, self._link.dataset_info, self._parts.fields, version)
        if isinstance(order, bool) or order not in ORDERS:  # (as the Plan says it, before any call)
            versions = " or ".join(str(o) for o in ORDERS)  # (`map` is an argument here)
            raise PlanError(f"order must be one of the order versions {versions}, got {order!r}")
        self.order, self._plan = int(order), None
        self.cursor = Cursor()
        self._start_process()

    # the options, as attributes (read-only views of `self.options`, as `DataLoader`'s)
    batch_size = property(lambda self: self.options.batch_size)
    shuffle = property(lambda self: self.options.shuffle)
    drop_last = property(lambda self: self.options.drop_last)
    seed = property(lambda self: self.options.seed)
    rank = property(lambda self: self.options.rank)
    world_size = property(lambda self: self.options.world_size)
    shuffle_window = property(lambda self: self.options.shuffle_window)
    decode = property(lambda self: self.options.decode)
    transform = property(lambda self: self.options.transform)
    on_error = property(lambda self: self.options.on_error)
    output = property(lambda self: self.options.output)
    device = property(lambda self: self.options.device)
    share = property(lambda self: self.options.share)
    tuple_fields = property(lambda self: self.options.tuple_fields)

    def _init_process_local(self) -> None:
        self._tally = Tally()  # stats(): batches, bytes, waits, stage times
        self._ahead: tuple[int, Receiver] | None = None  # the next epoch's pass, opened ahead: (epoch, receiver)

    def _enter_process(self) -> None:
        """In a forked child, leave the parent's epoch, channels and locks alone and start afresh."""
        self._check_process()
        self._link.enter_process()

    # -- plan, from the servers' DatasetInfo ------------------------------------------------------
    @property
    def plan(self):
        """The `gdsload.plan.plan.Plan` (or `MixPlan`) of this rank: the source's, as a local
        loader makes it (asks the server for the dataset on first use), in order `order`; for an
        order other than 1 the server is asked whether it serves it (`ServerInfo.orders`)."""
        if self._plan is None:
            self._enter_process()
            plan = self.source.make_plan(**self.options.plan_args(), order=self.order)
            if plan.order != 1:  # an older server refuses each request of it: say why before any
                self._check_order_served(plan.order)
            self._plan = plan
        return self._plan

    def _check_order_served(self, order: int) -> None:
        served = request_rules.served_orders(self.server_info())
        if order not in served:
            address = self._link.address()
            raise RemoteError(
                f"the server at {address} serves the orders {', '.join(map(str, served))} (ServerInfo.orders; "
                f"none listed: a server older than order versions) and this loader plans order {order}: upgrade "
                f"the server, or pass RemoteLoader(..., order=1) (the order of DataLoader(order=1))",
                code="FAILED_PRECONDITION", address=address)

    def dataset_info(self, name: str | None = None) -> pb.DatasetInfo:
        """The server's `DatasetInfo` of this dataset (name, id, shard sizes, fields, manifest); of
        a mix, that of its dataset `name`."""
        self._enter_process()
        return self.source.info(name)

    def server_info(self) -> pb.ServerInfo:
        self._enter_process()
        return self._link.unary("GetServerInfo", pb.GetServerInfoRequest())

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
        self.cursor.load(epoch, position)  # stops a live pass first (gdsload.frontend.cursor)

    def skip(self, n: int) -> None:
        """As `DataLoader.skip` (`PlanCursor.skip`): the next `n` global steps are not served.
        During a pass its stream is cancelled, the batches received ahead dropped, and the servers
        asked again from the new position (`start_position`), so none of them reads the skipped
        steps; the loop goes on over the same iterator (`RemoteEpoch.skip_to`)."""
        super().skip(n)

    def __iter__(self) -> RemoteEpoch:
        self._enter_process()
        keep_large_blocks()  # received messages of megabytes: no page faults each (gdsload.host.malloc)
        active = self.cursor.live()
        if active is not None:
            active.close()
        return RemoteEpoch(self._open_receiver, self.cursor,
                           functools.partial(self._output.convert, stages=self._tally.stages), self._tally,
                           restart=self.__iter__, end=self.plan.end_position,
                           ahead=self._open_ahead if self.prefetch_next_epoch else None)

    def _open_receiver(self, epoch: int, position: int) -> Receiver:
        """The receiver of a pass from `position` of `epoch`: the one opened ahead when it is that
        pass and still of use (`Receiver.claim`), else a new one (and the one ahead is cancelled)."""
        ahead = self._ahead
        if ahead is not None and ahead[0] == epoch and position == 0 and ahead[1].claim():
            self._ahead = None
            return ahead[1]
        self._drop_ahead()
        return self._new_receiver(epoch, position)

    def _drop_ahead(self) -> None:
        """Cancel the pass opened ahead, if any."""
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None

    def _open_ahead(self, epoch: int) -> None:
        """A pass in its epoch's tail opens the next epoch's (`RemoteEpoch`, `ahead`): its
        receiver starts now and the next `iter()` takes it over when it starts there. Nothing is
        raised here: a receiver that cannot be opened now is opened by that `iter()`."""
        self._drop_ahead()
        try:
            receiver = self._new_receiver(epoch, 0)
        except Exception:
            return
        receiver.ahead = True
        receiver.start()
        self._ahead = (epoch, receiver)

    def _new_receiver(self, epoch: int, position: int) -> Receiver:
        """A receiver of a pass from `position` of `epoch`: striped, or one server at a time."""
        plan, link = self.plan, self._link
        dataset, mix = self.source.request_target(plan)
        template = self._parts.request(self.options, plan, dataset=dataset, mix=mix, epoch=epoch, position=position)
        where = dict(epoch=epoch, position=position, global_batch=plan.global_batch, end=plan.end_position,
                     prefetch=self.prefetch, stages=self._tally.stages)
        if self.striped:
            return StripedReceiver(link, template, policy=self.striping, dataset_id=plan.dataset_id, **where)
        return SingleReceiver(link, template, **where)

    def stats(self) -> dict[str, Any]:
        """batches, bytes (batch bodies), shared_batches (of those, the batches a server sent as a copy
        of one it made for another loader of the share group: read and decoded once for both; 0
        without `share`), reconnects, wait_s (time the caller waited), address (the
        one unary calls and an unstriped stream use), and `servers`: per server address (each
        address a `dns:///` name resolved to), since the loader was made: `batches` and `bytes`
        it delivered (first copies only), `in_flight` (batches asked of it and not received yet),
        `wait_s` (time the plan-order head waited for a batch in flight there; unstriped: the
        caller's waits while it was the address in use), `failures` (failed calls and probes),
        `stalls` (requests cancelled after `stall_timeout_s` of silence), `duplicates` (batches
        it sent that had arrived from another server already, dropped), `state` (new, ok,
        suspect: stalled, down: failing, refused: another dataset version or cannot serve this
        request, gone: no longer resolved, paused: held back for higher-priority work;
        `gdsload.service.client.stripe.states`), `pauses`, `paused_s`, `paused_reason`, `paused_at`
        (how often, how long, why and when, as `time.time()`, its streams were last paused for
        higher-priority work). `servers_needed`: the servers in use times the loop's time over its
        time not waiting since its first batch (the servers that would have fed it without a stall
        at the rate seen; None before two batches).

        `stages`, shaped as `DataLoader.stats()["stages"]` (`gdsload.frontend.stages.StageTimes`):
        wall seconds since the loader was made, `total_s` and `per_batch_s` (over the batches
        handed out), of `receive` (the receiving threads waiting for and assembling the chunks of
        batches, server time and network included; with striping summed over the requests in
        flight, so they overlap), `map` (`map` / `collate_fn`, in the caller's thread) and `wait`
        (the caller waiting for a batch: `wait_s`)."""
        tally, servers = self._tally, self._link.server_stats()
        used = sum(1 for row in servers.values() if row["batches"]) if self.striped else 1
        return dict(tally.counts, reconnects=self._link.reconnects, address=self._link.address(),
                    servers=servers, stages=tally.stages.report(tally.counts["batches"]),
                    servers_needed=tally.servers_needed(max(1, used)))

    def close(self) -> None:
        self._enter_process()
        active = self.cursor.live()
        if active is not None:
            active.close()
        self._drop_ahead()
        self._link.channels.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"gdsload.RemoteLoader({self.addresses!r}, dataset={self.dataset!r}, "
                f"batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size})")


@dataclass(frozen=True)
class RequestParts:
    """What a loader's requests say beside its plan and cursor: the transform's spec, the
    video/audio specs (`gdsload.service.protocol.mediawire`), the fields asked (without the meta
    fields), the largest chunk and `batches_per_stream`."""

    transform_spec: Any
    media: list
    fields: list[str]
    max_chunk_bytes: int
    max_batches: int
    priority: int = 0
    job: str = ""

    @classmethod
    def of(cls, opts: LoaderOptions, fields: Sequence[str] | None, max_chunk_bytes: int,
           max_batches: int, priority: int = 0, job: str = "") -> RequestParts:
        media = []
        if opts.media:  # video/audio decoded on the server
            from gdsload.service.protocol import mediawire

            media = mediawire.to_specs(opts.media)
        return cls(transform_spec=imagewire.transform_to_spec(opts.transform) if opts.decode else None, media=media,
                   fields=[f for f in (fields or []) if f not in (wire.KEY, wire.SOURCE)],
                   max_chunk_bytes=max_chunk_bytes, max_batches=max_batches, priority=priority, job=job)

    def request(self, opts: LoaderOptions, plan: Any, **where: Any) -> pb.BatchRequest:
        """The request for `plan`'s batches from `where` (dataset, mix, epoch, position)."""
        return request_rules.to_request(opts, plan, transform_spec=self.transform_spec, media=self.media,
                                        fields=self.fields, max_chunk_bytes=self.max_chunk_bytes,
                                        max_batches=self.max_batches, priority=self.priority, job=self.job,
                                        **where)


def check_priority(priority: Any, job: str | None) -> tuple[int, str]:
    """(priority, job) checked: an int of the proto's int32, and a job id of at most 128
    characters (None: a new random id)."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) or not -2**31 <= priority < 2**31:
        raise ConfigError(f"priority must be an integer (int32; higher first, default 0), got {priority!r}")
    if job is None:
        job = uuid.uuid4().hex
    if not isinstance(job, str) or not 1 <= len(job) <= request_rules.MAX_JOB_CHARS:
        raise ConfigError(f"job must be a string of 1 to {request_rules.MAX_JOB_CHARS} characters, got {job!r}")
    return int(priority), job
