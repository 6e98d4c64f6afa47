"""Batches <-> BatchChunk messages (an image transform on the wire: `imagewire`).

Wire layout (documented in proto/gdsload/v1/feed.proto): a batch is a header (keys, and per field
its layout, dtype, shape or item lengths, byte count) and a body, the fields' bytes one after
another. The body is cut into chunks so that no message exceeds `max_chunk_bytes`; the header
rides in chunk 0.

Copies of each byte of a raw batch (what the wire benchmark moves), one by one:
- server: (1) the kernel copies the shard bytes from the page cache into the batch's staging
  buffer (the loader's read, as locally); (2) `encode_batch` joins the batch's fields straight
  from there into the chunk message (one copy instead of protobuf's three: join, message,
  serialization; a `BytesColumn` packed back to back goes as one piece); (3) gRPC Python copies the
  message `bytes` into a gRPC slice (`grpc_slice_from_copied_buffer`); (4) the kernel copies it
  into the socket.
- client: (1) the kernel copies it out of the socket into gRPC core's read slices; (2) and (3)
  gRPC Python makes a `bytes` of each slice and joins them into the message (grpcio 1.85 without
  its zero-copy experiment); `split_chunk` takes `data` out of the message without a copy
  (protobuf would copy twice); then a batch of one message is used where it lies: byte fields
  are `BytesColumn`s over the message (no copy; a member becomes `bytes` when asked for, as in
  the local loader's batches), tensor fields are copied once into writable arrays
  (`torch.from_numpy` warns about read-only ones); (4) only a batch of several messages is
  assembled, once, into one buffer its fields are views of (NumPy, not zero-filled: from 4 MiB on
  the kernel backs it with huge pages instead of one fault per 4 KiB page).
So a raw batch that fits in one message (`Limits.max_message_bytes`) costs the server two copies
of its own and gRPC's one, and the client gRPC's two; the kernel's copies are the socket's.
Over the bulk connection (`gdsload.service.server.bulk`, the default where the server offers it) the
server's (2) and (3) and the client's (2) and (3) are gone: `encode_frames`' pieces go to
`sendmsg` where they lie, and the client reads each chunk's data into its place in the body.
A raw batch sent as stored (`gdsload.service.server.stored`: its fields `StoredColumn`s, their pieces
`FileSpan`s that the bulk connection writes with `sendfile`) skips the server's (1) as well: the
kernel's copy into the socket takes the page cache's bytes. Its members' CRC32s then travel in
`FieldData.item_crc32` and `decode_body` checks them on the client.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, repeat
from typing import Any, NamedTuple

import numpy as np

from gdsload.errors import ProtocolError  # noqa: F401 (re-exported: defined in errors.py)
from gdsload.format.crc import first_mismatch
from gdsload.frontend.fields import BytesColumn, to_wire
from gdsload.service.protocol.config import CHUNK_OVERHEAD_BYTES
from gdsload.service.protocol.status import CorruptCopy, OverLimit
from gdsload.v1 import feed_pb2 as pb

KEY = "__key__"
SOURCE = "__source__"  # per sample, the dataset of a mix it comes from (BatchHeader.sources)


# -- server: batch -> chunks ---------------------------------------------------------------------
class FileSpan(NamedTuple):
    """`nbytes` bytes at `offset` of the open file `fd`: a piece of a message that the bulk
    connection sends with `os.sendfile` (`gdsload.service.server.bulk.BulkSink`)."""

    fd: int
    offset: int
    nbytes: int


class StoredColumn(NamedTuple):
    """A batch's bytes field whose members are still in their files, sent as stored: member i is
    `sizes[i]` bytes at `offsets[i]` of descriptor `fds[i]`; `crc32`: each member's CRC32 as
    the index has it (`FieldData.item_crc32`; None: nothing to check)."""

    fds: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    crc32: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def spans(self) -> list[FileSpan]:
        """The members as `FileSpan`s, one per run of members that follow each other in a file
        (members of no bytes take none). Array operations: no Python call per member."""
        fds, offs, sizes = self.fds, self.offsets, self.sizes
        if not sizes.all():
            keep = sizes != 0
            fds, offs, sizes = fds[keep], offs[keep], sizes[keep]
        if len(sizes) > 1:
            joined = (fds[1:] == fds[:-1]) & (offs[1:] == offs[:-1] + sizes[:-1])  # follows the one before
            if joined.any():
                first = np.concatenate(([0], (~joined).nonzero()[0] + 1))
                fds, offs, sizes = fds[first], offs[first], np.add.reduceat(sizes, first)
        return list(map(tuple.__new__, repeat(FileSpan), zip(fds.tolist(), offs.tolist(), sizes.tolist())))


def _cut(piece: Any, start: int, n: int) -> Any:
    """Bytes `[start, start + n)` of a message piece."""
    if type(piece) is FileSpan:
        return FileSpan(piece.fd, piece.offset + start, n)
    view = memoryview(piece)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view[start : start + n]


_DATA_TAG = bytes([(7 << 3) | 2])  # BatchChunk.data: field 7, wire type 2 (length-delimited)


def data_prefix(n: int) -> bytes:
    """What precedes `n` bytes of BatchChunk.data in a serialized message: its tag and length."""
    return _DATA_TAG + _varint(n)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_batch(batch: Mapping[str, Any], *, epoch: int, step: int, position: int,
                 max_chunk_bytes: int, skipped_keys: Sequence[str] = (),
                 end_position: int = 0) -> Iterator[bytes]:
    """The serialized BatchChunk messages of one batch (a dict field -> NumPy array or list of
    bytes, plus "__key__"), each at most `max_chunk_bytes` long.

    The messages are built by hand: the small fields through protobuf, then `data` (field 7)
    appended as tag, length and the batch's bytes, joined straight from the arrays and byte
    strings. That is exactly protobuf's encoding of BatchChunk, with one copy of the data instead
    of three (join, message, serialization).
    """
    for pieces in encode_frames(batch, epoch=epoch, step=step, position=position,
                                max_chunk_bytes=max_chunk_bytes, skipped_keys=skipped_keys,
                                end_position=end_position):
        yield b"".join(pieces)


def encode_frames(batch: Mapping[str, Any], *, epoch: int, step: int, position: int,
                  max_chunk_bytes: int, skipped_keys: Sequence[str] = (),
                  end_position: int = 0) -> Iterator[list[Any]]:
    """`encode_batch`'s messages unjoined: each a list of buffers (the message's head as bytes,
    then views of the batch's own arrays and byte strings) whose concatenation is the message.
    The bulk connection writes them with one `sendmsg` each; the views are valid until the
    batch's memory is reused (the loader's next batch)."""
    keys = list(batch.get(KEY, ()))
    fields, pieces = _encode_fields(batch)
    body = sum(f.nbytes for f in fields)
    header = pb.BatchHeader(num_samples=len(keys), keys=keys, fields=fields, skipped=len(skipped_keys),
                            skipped_keys=skipped_keys, body_nbytes=body, end_position=end_position,
                            sources=list(batch.get(SOURCE, ())))
    first_room = max_chunk_bytes - CHUNK_OVERHEAD_BYTES - header.ByteSize()
    if first_room <= 0:
        raise OverLimit(
            f"the header of one batch (keys and field layout of {len(keys)} samples) takes "
            f"{header.ByteSize()} bytes, more than the message limit of {max_chunk_bytes} bytes; "
            f"lower batch_size or raise the message limit"
        )
    room = max_chunk_bytes - CHUNK_OVERHEAD_BYTES
    sent = 0
    for chunk_index, (parts, got) in enumerate(_cut_pieces(pieces, first_room, room)):
        sent += got
        last = sent >= body
        meta = pb.BatchChunk(step=step, position=position, epoch=epoch, chunk_index=chunk_index, last=last,
                             header=header if chunk_index == 0 else None).SerializeToString()
        yield [meta + data_prefix(got), *parts] if got else [meta]
        if last:
            return


def _encode_fields(batch: Mapping[str, Any]) -> tuple[list[pb.FieldData], list[Any]]:
    """The `FieldData` of each field of a batch (keys and sources aside) and the body's pieces,
    in order: bytes-like views of the batch's own memory, or `FileSpan`s of stored members."""
    fields: list[pb.FieldData] = []
    pieces: list[Any] = []  # bytes-like objects, the body in order
    for name, value in batch.items():
        if name in (KEY, SOURCE):
            continue
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value)
            fields.append(pb.FieldData(name=name, layout=pb.FIELD_LAYOUT_TENSOR, dtype=arr.dtype.str,
                                       shape=arr.shape, nbytes=arr.nbytes))
            if arr.nbytes:
                pieces.append(memoryview(arr.reshape(-1).view(np.uint8)))
        elif isinstance(value, BytesColumn):  # the loader's bytes fields: views of the ring slot
            lengths = value.sizes.tolist()
            total = sum(lengths)
            fields.append(pb.FieldData(name=name, layout=pb.FIELD_LAYOUT_BYTES, item_nbytes=lengths,
                                       nbytes=total))
            offsets = value.offsets
            if total and len(lengths) > 1 and bool(np.all(offsets[1:] == offsets[:-1] + value.sizes[:-1])):
                start = int(offsets[0])  # packed back to back (a batch's own buffer): one piece
                pieces.append(memoryview(value.data[start : start + total]))
            else:
                pieces.extend(memoryview(value.view(i)) for i, n in enumerate(lengths) if n)
        elif isinstance(value, StoredColumn):  # members still in their files: FileSpans
            lengths = value.sizes.tolist()
            fields.append(pb.FieldData(name=name, layout=pb.FIELD_LAYOUT_BYTES, item_nbytes=lengths,
                                       nbytes=sum(lengths),
                                       item_crc32=() if value.crc32 is None else value.crc32.tolist()))
            pieces.extend(value.spans())
        elif isinstance(value, (list, tuple)):
            value = [v if isinstance(v, (bytes, bytearray, memoryview)) else to_wire(v) for v in value]
            lengths = [memoryview(v).nbytes for v in value]  # text, json, ragged .npy: bytes items
            fields.append(pb.FieldData(name=name, layout=pb.FIELD_LAYOUT_BYTES, item_nbytes=lengths,
                                       nbytes=sum(lengths)))
            pieces.extend(v for v, n in zip(value, lengths) if n)
        else:
            raise TypeError(f"field {name!r}: cannot send a {type(value).__name__}")
    return fields, pieces


def _cut_pieces(pieces: Sequence[Any], first_room: int, room: int) -> Iterator[tuple[list[Any], int]]:
    """The body's pieces (none empty) cut into chunks of `first_room` bytes (the first, beside the
    header), then `room`: (the chunk's parts, its bytes), whole pieces where they fit, never
    copied. At least one chunk, and then as many as the body needs; the caller stops at the last.
    The pieces that fit whole are found by bisection of their ends: no Python call per piece (a
    stored batch has a piece per member)."""
    sizes = [p.nbytes if type(p) is FileSpan else memoryview(p).nbytes for p in pieces]
    ends = list(accumulate(sizes))
    count = len(pieces)
    i = pos = 0  # the next piece (`pos` inside it: its first bytes went in the chunk before), bytes cut
    want = first_room
    while True:
        start, limit = pos, pos + want
        parts: list[Any] = []
        if i < count and pos > ends[i] - sizes[i]:  # the rest of a piece cut before
            stop = min(ends[i], limit)
            parts.append(_cut(pieces[i], pos - (ends[i] - sizes[i]), stop - pos))
            pos = stop
            i += stop == ends[i]
        if pos < limit:
            j = bisect_right(ends, limit, i)
            if j > i:  # whole pieces
                parts += pieces[i:j]
                pos, i = ends[j - 1], j
            if i < count and pos < limit:  # the next piece does not fit: its first bytes
                parts.append(_cut(pieces[i], 0, limit - pos))
                pos = limit
        yield parts, pos - start
        want = room


def body_nbytes(batch: Mapping[str, Any]) -> int:
    """Bytes of a batch's body (all fields but the keys and sources)."""
    n = 0
    for name, value in batch.items():
        if name not in (KEY, SOURCE):
            n += value.nbytes if isinstance(value, (np.ndarray, BytesColumn, StoredColumn)) else sum(memoryview(
                v if isinstance(v, (bytes, bytearray, memoryview)) else to_wire(v)).nbytes for v in value)
    return n


# -- client: chunks -> batch ---------------------------------------------------------------------
def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtocolError("truncated varint in a BatchChunk")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def split_chunk(raw: bytes) -> tuple[pb.BatchChunk, memoryview]:
    """A serialized BatchChunk as (the message without `data`, a zero-copy view of `data`).

    Used as the client's deserializer: protobuf would copy the data twice (into the message, then
    into a new bytes object on access). Accepts any valid encoding (fields in any order).
    """
    buf = memoryview(raw)
    pos = 0
    data = buf[0:0]
    rest: list[memoryview] = []
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type == 2:
            n, pos = _read_varint(buf, pos)
            if number == 7:
                data = buf[pos : pos + n]
                pos += n
                continue
            pos += n
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ProtocolError(f"BatchChunk field {number} has unsupported wire type {wire_type}")
        rest.append(buf[start:pos])
    if pos != len(buf):
        raise ProtocolError("a BatchChunk ends inside a field")
    meta = pb.BatchChunk.FromString(b"".join(rest) if len(rest) != 1 else bytes(rest[0]))
    return meta, data


#: Received bodies from this size on come from the loader's pool (`link._Channels.bodies`); a
#: pooled buffer is at least 4 MiB (`StagingPool`), so smaller bodies, whose pages glibc's heap
#: reuses anyway, are allocated as they are: a consumer that keeps many small batches does not
#: hold 4 MiB for each.
POOLED_BODY_BYTES = 2 << 20


def new_body(nbytes: int, bodies: Any = None) -> np.ndarray:
    """A buffer for a received batch body of `nbytes` (not zero-filled): from `bodies`, a
    `StagingPool` (memory touched before: a new buffer's pages are cleared by the kernel at first
    touch), when there is one and the body is large."""
    if bodies is not None and nbytes >= POOLED_BODY_BYTES:
        return bodies.take(nbytes)
    return np.empty(nbytes, np.uint8)


class ChunkAssembler:
    """Collects the chunks of one batch; `add` returns the batch once its last chunk arrived."""

    def __init__(self, bodies: Any = None) -> None:
        self._bodies = bodies  # a `StagingPool` for the bodies of batches of several chunks, or None
        self._header: pb.BatchHeader | None = None
        self._body: np.ndarray | None = None
        self._filled = 0
        self._next_chunk = 0
        self._step = -1

    def add(self, chunk: pb.BatchChunk, data: bytes | memoryview | None = None) -> dict[str, Any] | None:
        """Take one chunk (`data`: its data, when `split_chunk` took it out of the message)."""
        if data is None:
            data = chunk.data
        if chunk.chunk_index != self._next_chunk:
            raise ProtocolError(f"expected chunk {self._next_chunk} of a batch, got {chunk.chunk_index}")
        if chunk.chunk_index == 0:
            if not chunk.HasField("header"):
                raise ProtocolError(f"chunk 0 of step {chunk.step} has no header")
            self._header = chunk.header
            self._step = chunk.step
            if chunk.last:  # the whole batch in one message: no staging copy
                if len(data) != chunk.header.body_nbytes:
                    raise ProtocolError(f"step {chunk.step}: got {len(data)} of {chunk.header.body_nbytes} bytes")
                # a writable message (the bulk connection's buffer, given away) is used where it lies
                return decode_body(chunk.header, data, owned=not memoryview(data).readonly)
            self._body = new_body(chunk.header.body_nbytes, self._bodies)
            self._filled = 0
        elif chunk.step != self._step:
            raise ProtocolError(f"chunk {chunk.chunk_index} is of step {chunk.step}, expected {self._step}")
        end = self._filled + len(data)
        if end > len(self._body):
            raise ProtocolError(f"step {chunk.step}: chunks carry more than the {len(self._body)} bytes announced")
        self._body[self._filled:end] = np.frombuffer(data, np.uint8)
        self._filled = end
        if not chunk.last:
            self._next_chunk += 1
            return None
        if self._filled != len(self._body):
            raise ProtocolError(f"step {chunk.step}: got {self._filled} of {len(self._body)} bytes")
        self._next_chunk = 0
        body, self._body = self._body, None
        return decode_body(self._header, body, owned=True)


BatchAssembler = ChunkAssembler  # its name before issue 48 (loader.assemble has a BatchAssembler too)


def decode_body(header: pb.BatchHeader, body: Any, *, owned: bool = False) -> dict[str, Any]:
    """The batch dict: tensors as writable arrays (views of `body` when `owned`, a writable buffer
    the caller gives away; else copies), byte fields as `BytesColumn`s over `body` (no copy: a
    member becomes `bytes` when asked for, as in the local loader's batches; read-only views of
    a received message that is not `owned`)."""
    out: dict[str, Any] = {}
    offset = 0
    view = memoryview(body)
    data = None  # the body as uint8, once: byte fields are columns over it
    for f in header.fields:
        if f.layout == pb.FIELD_LAYOUT_TENSOR:
            dtype = np.dtype(f.dtype)
            shape = tuple(f.shape)
            count = int(np.prod(shape, dtype=np.int64))
            if count * dtype.itemsize != f.nbytes:
                raise ProtocolError(f"field {f.name!r}: {f.dtype}{list(shape)} is not {f.nbytes} bytes")
            src = view[offset : offset + f.nbytes] if owned else bytearray(view[offset : offset + f.nbytes])
            out[f.name] = np.frombuffer(src, dtype=dtype, count=count).reshape(shape)
        elif f.layout == pb.FIELD_LAYOUT_BYTES:  # a BytesColumn over the body, as the local loader's
            sizes = np.array(f.item_nbytes, np.int64)
            if int(sizes.sum()) != f.nbytes:
                raise ProtocolError(f"field {f.name!r}: item lengths do not add up to {f.nbytes}")
            if data is None:
                data = np.frombuffer(view, np.uint8)
            offsets = np.empty(len(sizes), np.int64)
            if len(sizes):
                offsets[0] = offset
                np.cumsum(sizes[:-1], out=offsets[1:])
                offsets[1:] += offset
            if f.item_crc32:  # sent as stored, unchecked by the server (gdsload.service.server.stored)
                _check_items(f, view, offsets, sizes, header.keys)
            out[f.name] = BytesColumn(data, offsets, sizes)
        else:
            raise ProtocolError(f"field {f.name!r}: unknown layout {f.layout}")
        offset += f.nbytes
    out[KEY] = list(header.keys)
    if header.sources:
        out[SOURCE] = list(header.sources)
    return out


def _check_items(f: pb.FieldData, view: memoryview, offsets: np.ndarray, sizes: np.ndarray,
                 keys: Sequence[str]) -> None:
    """The CRC32 of each item of bytes field `f` (in `view`, the body) against `f.item_crc32`,
    the field's items (back to back) in one run, as the loader checks staged members
    (`gdsload.format.crc.first_mismatch`)."""
    if len(f.item_crc32) != len(sizes):
        raise ProtocolError(f"field {f.name!r}: {len(f.item_crc32)} CRC32s for {len(sizes)} items")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    bad = first_mismatch(view, offsets, sizes, np.array(f.item_crc32, np.int64))
    if bad is not None:
        i, got, _ = bad
        want = f.item_crc32[i]
        key = keys[i] if i < len(keys) else f"item {i}"
        raise CorruptCopy(
            f"sample {key!r}: field {f.name!r} as the server sent it has CRC32 {got:08x}, the "
            f"dataset's index says {want:08x}: the server's copy of the shard changed on disk "
            f"(run gdsload verify there)"
        )


# -- transforms ------------------------------------------------------------------------------------
