"""`BatchRequest` <-> `LoaderOptions`: the one mapping between the feed's request and the options
both loaders share (`gdsload.frontend.options`); the role of every request field (`ROLE`); and the
combinations of request features the server serves (`check_combination`, `stored_refusal`,
`offers_bulk`: their one home).

`to_request` is what `RemoteLoader` sends for its options, plan and cursor; `to_options` is what
the server reads back, validated with the same rules as a local `DataLoader`'s options (an
invalid value is a `BadRequest`, INVALID_ARGUMENT, naming the request field). The server's own
settings (reader threads, prefetch, decode threads, device "cpu", NumPy output, no copies) are not
the client's to choose and are not in the request.

Order versions (`gdsload.plan.plan`): a request names its plan's order in `dataset_id`, the id
alone for order 1 and the id followed by ``;order=2`` for order 2 (`with_order`, `split_order`).
Not a field of its own, on purpose: a server older than order versions would ignore a new field
and serve order 1 to a client that planned order 2, while it compares the whole `dataset_id` with
its dataset's id and refuses (FAILED_PRECONDITION) one that carries an order. A request of order 1
is byte for byte the one made before order versions. `ServerInfo.orders` (`SERVED_ORDERS`) lists
what a server serves; `served_orders` reads it (an older server's empty list: order 1).
"""

from __future__ import annotations

import enum
import math
from typing import Any

from gdsload.errors import BadRequest, ConfigError, DatasetChanged
from gdsload.frontend.options import LoaderOptions
from gdsload.plan.plan import ORDERS
from gdsload.v1 import feed_pb2 as pb

PAYLOADS = {pb.PAYLOAD_UNSPECIFIED: "raw", pb.PAYLOAD_RAW: "raw", pb.PAYLOAD_DECODED: "decoded"}
ON_ERROR = {pb.ON_ERROR_UNSPECIFIED: "raise", pb.ON_ERROR_RAISE: "raise", pb.ON_ERROR_SKIP: "skip"}


#: The order versions a server of this code serves (`ServerInfo.orders`).
SERVED_ORDERS: tuple[int, ...] = ORDERS
#: Longest `BatchRequest.job` accepted.
MAX_JOB_CHARS = 128
#: What follows the id in `BatchRequest.dataset_id` to name an order other than 1.
ORDER_TAG = ";order="


def with_order(dataset_id: str, order: int) -> str:
    """`BatchRequest.dataset_id` for a plan of `dataset_id` in order version `order`: the id alone
    for order 1 (as before order versions), else the id followed by ``;order=N``."""
    return dataset_id if order == 1 else f"{dataset_id}{ORDER_TAG}{order}"


def split_order(dataset_id: str) -> tuple[str, int]:
    """(the dataset id, the order version) that a `BatchRequest.dataset_id` names (no tag: order 1).
    A malformed tag is a `BadRequest`; an order this server does not serve is refused as an older
    server refuses any tag (`DatasetChanged`: FAILED_PRECONDITION), naming the orders served."""
    ident, tag, version = dataset_id.rpartition(ORDER_TAG)
    if not tag:
        return dataset_id, 1
    if not (version.isascii() and version.isdigit()) or len(version) > 9:
        raise BadRequest(f"BatchRequest.dataset_id {cut(dataset_id)!r} ends in {cut(tag + version)!r}: "
                         f"an order is named as '{ORDER_TAG}' and a version number (e.g. '{ORDER_TAG}2')")
    order = int(version)
    if order not in SERVED_ORDERS:
        raise DatasetChanged(f"BatchRequest.dataset_id {cut(dataset_id)!r} asks for order {order}; this server "
                             f"serves the orders {', '.join(map(str, SERVED_ORDERS))} (ServerInfo.orders)")
    return ident, order


def served_orders(info: pb.ServerInfo) -> tuple[int, ...]:
    """The order versions a server's `ServerInfo` says it serves (none listed: an older server,
    which serves order 1 only)."""
    return tuple(info.orders) or (1,)


def to_request(opts: LoaderOptions, plan: Any, *, dataset: str, mix: Any, epoch: int, position: int,
               transform_spec: Any, media: Any, fields: list[str], max_chunk_bytes: int,
               max_batches: int, priority: int = 0, job: str = "") -> pb.BatchRequest:
    """The request for `plan`'s batches from `position` of `epoch` (`mix`: a `pb.MixSpec` or None;
    `media`: the video/audio specs of `gdsload.service.protocol.mediawire`); `dataset_id` names the
    plan's order (`with_order`). `priority` and `job`: the loader's (it understands pauses)."""
    return pb.BatchRequest(
        dataset="" if mix is not None else dataset, dataset_id=with_order(plan.dataset_id, plan.order), mix=mix,
        seed=plan.seed,
        epoch=epoch, shuffle=plan.shuffle, shuffle_window=plan.window, drop_last=plan.drop_last,
        batch_size=plan.batch_size, rank=plan.rank, world_size=plan.world_size, start_position=position,
        payload=pb.PAYLOAD_DECODED if opts.decode else pb.PAYLOAD_RAW, transform=transform_spec,
        fields=fields, media=media, on_error=pb.ON_ERROR_SKIP if opts.on_error == "skip" else pb.ON_ERROR_RAISE,
        max_chunk_bytes=max_chunk_bytes, max_batches=max_batches, share=opts.share or "",
        checks_item_crc32=True,  # wire.decode_body checks FieldData.item_crc32
        priority=priority, job=job, understands_pause=True,  # receive.read_batches takes BatchChunk.pause
    )


def check_finite(msg: Any, path: str = "BatchRequest") -> None:
    """Refuse (BadRequest, INVALID_ARGUMENT) a NaN or infinite value in any `float`/`double`
    field of `msg` or of the messages in it (image, video and audio transforms, mix weights),
    naming the field, e.g. `BatchRequest.media[0].video.scale_min`. No float field of the
    protocol means anything when not finite, and NaN passes every `<`/`>` range check after it."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for fd, value in msg.ListFields():
        repeated = fd.is_repeated
        items = list(enumerate(value)) if repeated else [(None, value)]
        for i, item in items:
            where = f"{path}.{fd.name}" + (f"[{i}]" if repeated else "")
            if fd.type == F.TYPE_MESSAGE:
                if fd.message_type.GetOptions().map_entry:
                    continue  # (no map of the protocol has float values)
                check_finite(item, where)
            elif fd.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT) and not math.isfinite(item):
                raise BadRequest(f"{where} must be a finite number, got {item!r}")


def to_options(req: pb.BatchRequest, *, max_image_side: int) -> LoaderOptions:
    """The loader options of a request, checked as a local loader's are (first: every float
    field finite, `check_finite`). The request's `fields` select the served dataset's fields
    (the catalog does that); the server's batches are dicts."""
    from gdsload.decode.image import ImageTransform
    from gdsload.service.protocol import imagewire

    check_finite(req)
    if req.payload not in PAYLOADS:
        raise BadRequest(f"payload {req.payload} is not one of PAYLOAD_RAW, PAYLOAD_DECODED")
    if len(req.job) > MAX_JOB_CHARS:
        raise BadRequest(f"BatchRequest.job is {len(req.job)} characters, at most {MAX_JOB_CHARS}")
    if req.on_error not in ON_ERROR:
        raise BadRequest(f"on_error {req.on_error} is not one of ON_ERROR_RAISE, ON_ERROR_SKIP")
    if req.share:  # the group is the server's business (gdsload.service.server.share); the name is checked here, once
        from gdsload.frontend.options import check_share

        try:
            check_share(req.share)
        except ConfigError as exc:
            raise BadRequest(f"BatchRequest.{exc}") from None
    decode = PAYLOADS[req.payload] == "decoded"
    if not decode and req.HasField("transform"):
        raise BadRequest("BatchRequest.transform is set but payload is PAYLOAD_RAW (samples as "
                         "stored): send payload = PAYLOAD_DECODED to decode on the server, or no "
                         "transform")
    transform = None
    if decode:
        transform = (imagewire.spec_to_transform(req.transform, max_side=max_image_side)
                     if req.HasField("transform") else ImageTransform())
    try:
        return LoaderOptions.create(
            remote=False, batch_size=req.batch_size, shuffle=req.shuffle, drop_last=req.drop_last,
            seed=req.seed, rank=req.rank, world_size=req.world_size or 1,
            shuffle_window=req.shuffle_window or 4, decode=decode, transform=transform,
            on_error=ON_ERROR[req.on_error], output="numpy", device="cpu", copy=False)
    except ConfigError as exc:
        raise BadRequest(f"BatchRequest: {exc}") from None


def loader_kwargs(opts: LoaderOptions) -> dict[str, Any]:
    """`DataLoader` keyword arguments for `opts` (the shared options only)."""
    return dict(batch_size=opts.batch_size, shuffle=opts.shuffle, drop_last=opts.drop_last, seed=opts.seed,
                rank=opts.rank, world_size=opts.world_size, shuffle_window=opts.shuffle_window,
                decode=opts.decode, transform=opts.transform, on_error=opts.on_error, output=opts.output,
                device=opts.device, copy=opts.copy)


# -- field roles ----------------------------------------------------------------------------------
class Role(enum.Enum):
    """What a `BatchRequest` field decides. IDENTITY: which batches (the loader is built from
    these: two requests that agree on them get the same batches, byte for byte, at the same
    steps); RANGE: which steps of them a stream takes; DELIVERY: how they travel or who shares
    the work, not what they are."""

    IDENTITY = "identity"
    RANGE = "range"
    DELIVERY = "delivery"


IDENTITY, RANGE, DELIVERY = Role.IDENTITY, Role.RANGE, Role.DELIVERY

#: Every `BatchRequest` field's role. A field added to the proto gets one here (tests/service/
#: test_request_roles.py fails until it does); until then `identity_key` keeps it (a request that
#: differs in it shares no loader and no group: never wrong, only slower).
ROLE: dict[str, Role] = {
    "dataset": IDENTITY, "dataset_id": IDENTITY, "seed": IDENTITY, "shuffle": IDENTITY,
    "shuffle_window": IDENTITY, "drop_last": IDENTITY, "batch_size": IDENTITY, "rank": IDENTITY,
    "world_size": IDENTITY, "payload": IDENTITY, "transform": IDENTITY, "fields": IDENTITY,
    "on_error": IDENTITY, "mix": IDENTITY, "media": IDENTITY,
    # a pass's windows (issue 54) instead of an epoch's batches: what the stream carries. An older
    # server refuses such a request (its `dataset` is empty), the proto's rule for what it decides
    "windows": IDENTITY,
    "epoch": RANGE, "start_position": RANGE, "max_batches": RANGE, "block_batches": RANGE,
    "block_stride": RANGE,
    "max_chunk_bytes": DELIVERY, "share": DELIVERY, "bulk": DELIVERY, "checks_item_crc32": DELIVERY,
    # who gets the server's work first (gdsload.service.server.priority), not what the batches are:
    # a share group's members may differ in them (the group runs at its highest member's priority)
    "priority": DELIVERY, "job": DELIVERY, "understands_pause": DELIVERY,
}


def unclassified(descriptor: Any = pb.BatchRequest.DESCRIPTOR) -> list[str]:
    """Fields of the request message `descriptor` without a role in `ROLE`, and roles of fields
    it does not have (both must be empty)."""
    names = [f.name for f in descriptor.fields]
    return [n for n in names if n not in ROLE] + [f"{n} (no such field)" for n in ROLE if n not in names]


def identity_key(req: pb.BatchRequest) -> bytes:
    """The request without its RANGE and DELIVERY fields, serialized deterministically: equal for
    two requests that get the same batches (the key of the server's parked loaders, with the
    served dataset's id, and of share groups, with the epoch, share name and caller)."""
    r = pb.BatchRequest()
    r.CopyFrom(req)
    for name, role in ROLE.items():
        if role is not IDENTITY:
            r.ClearField(name)
    return r.SerializeToString(deterministic=True)


# -- combinations ---------------------------------------------------------------------------------
def cut(text: str, limit: int = 64) -> str:
    """A client-sent id as echoed in a message: ids are short, anything longer is cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_combination(req: pb.BatchRequest) -> None:
    """Refuse (BadRequest) a combination of features the server never serves: `block_stride`
    (one stream of every stride-th block, a striping client's) needs `block_batches` and no share
    name (a share group's producers make consecutive steps)."""
    if req.block_stride > 1 and (not req.block_batches or req.share):
        raise BadRequest("block_stride needs block_batches >= 1 and no share name, got block_batches "
                         f"{req.block_batches} and share {cut(req.share)!r}")


def stored_refusal(req: pb.BatchRequest, *, bulk: bool) -> str | None:
    """Why the request's batches cannot be sent as stored members (`gdsload.service.server.stored`),
    as far as the request goes, or None: only raw, unshared batches without mix or media, whose
    client checks each member's CRC32 (the server does not see the bytes), on a bulk connection
    (gRPC cannot send from a file)."""
    if not bulk:
        return "not on a bulk connection"
    if req.payload == pb.PAYLOAD_DECODED:
        return "decoded"
    if not req.checks_item_crc32:
        return "the client does not check members' CRC32s (BatchRequest.checks_item_crc32)"
    if req.share:
        return "shared"
    if req.HasField("mix") or req.media:
        return "a mix" if req.HasField("mix") else "media decoded on the server"
    return None


def offers_bulk(*, wanted: bool, tls: bool, address: str) -> bool:
    """Whether a server offers the bulk connection (`BatchRequest.bulk`): when `wanted`, never
    with TLS (its bytes would travel unencrypted beside an encrypted call) nor on an abstract
    unix socket (no path beside which to put its own)."""
    return wanted and not tls and not address.startswith("unix-abstract:")
