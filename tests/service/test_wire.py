"""The chunk format: any batch survives the round trip, every message fits the limit, transforms
travel exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsload.decode.image import ImageTransform
from gdsload.frontend.fields import BytesColumn
from gdsload.service.protocol import imagewire, wire
from gdsload.service.protocol.status import BadRequest, OverLimit
from gdsload.v1 import feed_pb2 as pb


def _roundtrip(batch, limit):
    asm = wire.BatchAssembler()
    chunks = list(wire.encode_batch(batch, epoch=2, step=5, position=60, max_chunk_bytes=limit))
    out = None
    data = b""
    for i, raw in enumerate(chunks):
        assert isinstance(raw, bytes) and len(raw) <= limit
        c = pb.BatchChunk.FromString(raw)  # the hand-made encoding is plain protobuf
        assert (c.step, c.position, c.epoch) == (5, 60, 2)
        assert c.chunk_index == i and c.last == (i == len(chunks) - 1)
        assert c.HasField("header") == (i == 0)
        meta, view = wire.split_chunk(raw)
        assert bytes(view) == c.data and meta.chunk_index == i and not meta.data
        data += c.data
        got = asm.add(meta, view)
        assert (got is not None) == c.last
        out = got
    assert len(data) == wire.body_nbytes(batch)
    return out, [pb.BatchChunk.FromString(raw) for raw in chunks]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 20),
    shape=st.lists(st.integers(0, 7), max_size=3),
    dtype=st.sampled_from(["<f4", "<f2", "|u1", "<i8", "|b1", ">i4"]),
    blobs=st.lists(st.binary(max_size=3000), min_size=1, max_size=20),
    limit=st.integers(4096 + 256, 20000),
)
def test_any_batch_round_trips_under_the_limit(n, shape, dtype, blobs, limit):
    rng = np.random.default_rng(0)
    arr = (rng.integers(0, 255, size=(n, *shape)).astype(np.dtype(dtype)))
    batch = {"npy": arr, "jpg": blobs, "cls": np.arange(n, dtype=np.int64), "__key__": [f"k{i}" for i in range(n)]}
    out, _ = _roundtrip(batch, limit)
    assert list(out) == list(batch)
    assert out["npy"].dtype == arr.dtype and out["npy"].shape == arr.shape
    assert out["npy"].tobytes() == arr.tobytes() and out["npy"].flags.writeable
    assert out["jpg"] == blobs and out["__key__"] == batch["__key__"]
    assert isinstance(out["jpg"], BytesColumn)  # as the local loader's bytes fields


def test_a_one_chunk_batch_keeps_its_bytes_in_the_message():
    """The client's copies of a raw batch: byte fields are views of the received message (none),
    tensors one copy (writable arrays); a batch of several chunks is assembled once and both are
    views of that buffer."""
    blobs = [bytes([i]) * (1000 + i) for i in range(10)]
    batch = {"jpg": blobs, "cls": np.arange(10, dtype=np.int64), "__key__": [str(i) for i in range(10)]}
    (raw,) = wire.encode_batch(batch, epoch=0, step=0, position=10, max_chunk_bytes=1 << 20)
    out = wire.BatchAssembler().add(*wire.split_chunk(raw))
    message = np.frombuffer(raw, np.uint8)
    assert out["jpg"] == blobs and np.shares_memory(out["jpg"].data, message)
    assert out["cls"].flags.writeable and not np.shares_memory(out["cls"], message)
    asm = wire.BatchAssembler()
    chunks = list(wire.encode_batch(batch, epoch=0, step=0, position=10, max_chunk_bytes=4096 + 256))
    assert len(chunks) > 1
    for raw in chunks:
        out = asm.add(*wire.split_chunk(raw))
    assert out["jpg"] == blobs and out["cls"].tolist() == list(range(10))
    assert np.shares_memory(out["jpg"].data, out["cls"]) and out["cls"].flags.writeable


def test_packed_bytes_column_is_sent_as_one_piece():
    """A BytesColumn whose members lie back to back (a batch's own staging buffer) goes out as
    one piece; one with gaps (ring slot staging, 64-byte aligned) member by member: same bytes."""
    data = np.arange(256, dtype=np.uint8)
    packed = BytesColumn(data, np.array([0, 10, 30]), np.array([10, 20, 5]))
    gaps = BytesColumn(data, np.array([0, 64, 128]), np.array([10, 20, 5]))
    for col in (packed, gaps):
        out, _ = _roundtrip({"jpg": col, "__key__": ["a", "b", "c"]}, 1 << 20)
        assert out["jpg"] == col.tolist()


def test_big_batch_is_chunked():
    arr = np.arange(300_000, dtype=np.float32).reshape(100, 3000)
    out, chunks = _roundtrip({"x": arr, "__key__": [str(i) for i in range(100)]}, 64 * 1024)
    assert len(chunks) == 1 + -(-(arr.nbytes - len(chunks[0].data)) // (64 * 1024 - 256))
    assert np.array_equal(out["x"], arr)


def test_header_over_the_limit_is_over_limit():
    keys = ["k" * 200 + str(i) for i in range(100)]
    with pytest.raises(OverLimit, match="header"):
        list(wire.encode_batch({"__key__": keys, "x": np.zeros(100)}, epoch=0, step=0, position=1,
                               max_chunk_bytes=4096 + 256))


def test_missing_chunk_is_a_protocol_error():
    arr = np.zeros(20_000, dtype=np.uint8)
    chunks = list(wire.encode_batch({"x": arr, "__key__": ["a"]}, epoch=0, step=0, position=1,
                                    max_chunk_bytes=4096 + 256))
    asm = wire.BatchAssembler()
    asm.add(*wire.split_chunk(chunks[0]))
    with pytest.raises(wire.ProtocolError):
        asm.add(*wire.split_chunk(chunks[2]))


def test_split_chunk_accepts_any_field_order():
    c = pb.BatchChunk(step=1, position=2, chunk_index=0, last=True, data=b"xyz",
                      header=pb.BatchHeader(num_samples=1, keys=["a"], body_nbytes=3))
    raw = c.SerializeToString()
    meta, data = wire.split_chunk(raw)
    assert bytes(data) == b"xyz" and meta.header.keys == ["a"] and meta.last
    # data first, then the other fields: still one message
    d = pb.BatchChunk(data=b"xyz").SerializeToString()
    c.ClearField("data")
    meta, data = wire.split_chunk(d + c.SerializeToString())
    assert bytes(data) == b"xyz" and meta.position == 2


@pytest.mark.parametrize("t", [
    ImageTransform(),
    ImageTransform(size=64, train=False, resize=73, mean=None, std=None, layout="NHWC", dtype="uint8"),
    ImageTransform(size=17, scale=(0.3, 0.9), ratio=(0.7, 1.3), flip=0.1, dtype="float16"),
])
def test_transform_travels_exactly(t):
    spec = pb.ImageTransformSpec.FromString(imagewire.transform_to_spec(t).SerializeToString())
    assert imagewire.spec_to_transform(spec, max_side=4096) == t


def test_bad_transform_specs():
    good = imagewire.transform_to_spec(ImageTransform(size=32, train=False, resize=40))
    for change, words in [({"layout": "CHW"}, "layout"), ({"dtype": "int8"}, "dtype"),
                          ({"resize": 16}, "resize"), ({"flip": 2.0}, "flip")]:
        spec = pb.ImageTransformSpec()
        spec.CopyFrom(good)
        for k, v in change.items():
            setattr(spec, k, v)
        with pytest.raises(BadRequest, match=words):
            imagewire.spec_to_transform(spec, max_side=4096)
    with pytest.raises(OverLimit, match="limit of 36"):
        imagewire.spec_to_transform(good, max_side=36)
