"""What a stream may hold, in bytes, before it holds it: the figures `Budget.reserve` is asked for.

All of it comes from the loader's own `gdsload.loader.layout.BatchLayout` (decided before the
loader allocates anything) and the ring's own sizing rules, never from arithmetic of its own:

- `stream_bytes`: a stream's loader. Its ring's slots, `BatchLayout.slot_nbytes` (the one slot
  size computation: the loader's memory check and autotune use it too) times `prefetch + 1`. A
  loader that decodes nothing gives each batch its own staging buffer (`gdsload.ring.staging`,
  `buffer_nbytes`: a quarter over the batch's staged bytes, at least 4 MiB), at most one per slot
  and the batch being sent; labels the index holds are not staged (one staged label buffer is
  within `STREAM_OVERHEAD_BYTES`). A decoding stream adds `DECODE_BUFFERS` output batches inside
  DALI and `DECODER_OVERHEAD_BYTES` (also with the decode pool: each decoding stream reserves a
  pipeline's share, so the pool, at most one pipeline per attached stream, stays within the
  reservations), and the audio decoders' buffers (`mediawire.decode_nbytes`); every stream
  `STREAM_OVERHEAD_BYTES`; gRPC holds at most two chunks of `max_message_bytes` (the one being
  built and the one it has accepted but not yet sent, waiting for the client's flow-control
  window). A batch body over `Limits.max_batch_bytes` is refused here (RESOURCE_EXHAUSTED).
- `wire_bytes`: one batch serialized as chunks (what a share window holds per batch): the body
  (the slot's batch tensors and the largest staged members), `KEY_BYTES` of key and names per
  sample, 8 bytes per field and sample, and each chunk's framing.
- `order_bytes`: building a `Mix`'s epoch order (`gdsload.plan.mix.order_nbytes` of the request's
  order version), refused when over the whole budget before anything is built. Order 1 grows with
  the epoch (72 bytes per sample: a `samples_per_epoch` of 10^10 is refused); order 2 does not
  (its block cache and O(shards) per dataset, whatever the epoch's size).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gdsload.service.protocol.config import CHUNK_OVERHEAD_BYTES, Limits
from gdsload.service.protocol.status import OverLimit
from gdsload.v1 import feed_pb2 as pb

#: Decoder buffers of a decoding stream, in output batches: DALI's output and the decoded,
#: resized images before the crop (an upper bound for the usual source sizes).
DECODE_BUFFERS = 2
#: Fixed bytes of a stream (reader threads, I/O backend, allocator slack), and more for one that
#: decodes (DALI's pipeline and thread pool): measured 40-50 MB RSS for a decoding stream of 8 to
#: 64 images at 224 px on the CPU, over what its ring and buffers take.
STREAM_OVERHEAD_BYTES = 8 << 20
DECODER_OVERHEAD_BYTES = 64 << 20
#: Header bytes per sample of a serialized batch (its key, source name and framing), an estimate
#: for share windows; a window holds no more than it reserved whatever the keys (`share`).
KEY_BYTES = 256


def chunk_bytes(req: pb.BatchRequest, limits: Limits) -> int:
    """The largest chunk this server sends for `req` (max_chunk_bytes, at most the message limit)."""
    return min(req.max_chunk_bytes or limits.max_message_bytes, limits.max_message_bytes)


def batch_parts(layout: Any) -> tuple[int, int, int]:
    """(body, staged, image) bytes of one batch of `layout` on the host: the batch as sent (the
    slot's batch tensors, and each staged field's largest member per row), the staged members
    as the loader packs them, and one decoded image per row of every image field."""
    from gdsload.loader.gather import round_up

    rows = layout.rows
    body = staged = image = 0
    spec, host = layout.slot_fields(on_device=False, direct=False)
    for name, (shape, dtype) in {**spec, **host}.items():
        if name != "__staging__":  # batch tensors: .npy rows, decoded images and media, labels
            body += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    for fp in layout.fields:
        if fp.kind == "image":
            t = layout.transform
            image += int(np.prod(t.output_shape())) * np.dtype(t.dtype).itemsize
        elif fp.kind not in ("tensor", "label", "video", "audio"):  # sent as they were read
            body += rows * fp.max_nbytes
            staged += rows * round_up(fp.max_nbytes)
    return body, staged, image


def stream_bytes(layout: Any, *, prefetch: int, limits: Limits, dataset: str) -> int:
    """Upper bound of the bytes a stream's loader (of `layout`, `prefetch` batches ahead) holds,
    refusing a batch body over `limits.max_batch_bytes` (the module docstring has the terms)."""
    from gdsload.ring.staging import buffer_nbytes

    rows = layout.rows
    body, staged, image = batch_parts(layout)
    if body > limits.max_batch_bytes:
        raise OverLimit(
            f"a batch of {rows} samples of {dataset!r} can take up to {body} bytes "
            f"({body // max(1, rows)} per sample), over the server's limit of {limits.max_batch_bytes} "
            f"bytes per batch; lower batch_size"
        )
    slots = prefetch + 1
    memory = slots * layout.slot_nbytes()[1]
    if layout.own_staging and staged:
        memory += (slots + 1) * buffer_nbytes(staged)
    if image:
        memory += DECODE_BUFFERS * rows * image + DECODER_OVERHEAD_BYTES
    media = {fp.name: fp.media for fp in layout.media_fields}
    if media:  # decoding buffers of audio (issue 46)
        from gdsload.service.protocol import mediawire

        memory += mediawire.decode_nbytes(media, rows)
    return memory + STREAM_OVERHEAD_BYTES + 2 * limits.max_message_bytes


def wire_bytes(layout: Any, *, chunk: int) -> int:
    """Upper bound of one batch of `layout` serialized in chunks of at most `chunk` bytes."""
    rows, fields = layout.rows, len(layout.fields)
    body = batch_parts(layout)[0] + 8 * rows * fields
    chunks = body // max(1, chunk - CHUNK_OVERHEAD_BYTES) + 2
    return body + rows * KEY_BYTES + 64 * (fields + 1) + chunks * CHUNK_OVERHEAD_BYTES


def order_bytes(mix: Any, req: pb.BatchRequest, limit: int, order: int = 1) -> int:
    """The bytes building `mix`'s epoch order of version `order` takes, refused (RESOURCE_EXHAUSTED)
    when over the whole budget `limit`, before anything is built; the stream reserves them with
    its ring."""
    from gdsload.plan.mix import check_order_memory, order_nbytes
    from gdsload.plan.plan import PlanError

    G = req.batch_size * (req.world_size or 1)
    try:
        check_order_memory(mix.spec, G, limit, "the server's memory budget (--max-memory)", order)
    except PlanError as exc:
        raise OverLimit(f"mix {req.dataset!r}: {exc}") from None
    return order_nbytes(mix.spec, G, order)
