"""What an implementer of feed.proto relies on, checked against a real server on loopback: the end
of an epoch, dataset_id, field order, transform defaults, a transform sent with raw payloads,
empty batches and skipped keys, the bearer scheme, the health reference, protocol wording in
messages, and echoed values cut to fit gRPC's metadata limit."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest

from gdsload.service.protocol import imagewire, wire
from gdsload.service.server import create_server
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc

PROTO = (Path(__file__).resolve().parents[2] / "proto" / "gdsload" / "v1" / "feed.proto").read_text()
BAD = (2, 3, 5)  # corrupt images of the `bad` dataset: batch 1 (size 2) is all corrupt


def _stub(address):
    return pb_grpc.FeedStub(grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 26)]))


def _stream(address, **kw):
    """(header, batch) of every batch of one StreamBatches call."""
    asm = wire.BatchAssembler()
    out, header = [], None
    for chunk in _stub(address).StreamBatches(pb.BatchRequest(**kw), timeout=60):
        if chunk.chunk_index == 0:
            header = chunk.header
        batch = asm.add(chunk)
        if batch is not None:
            out.append((header, chunk.position, batch))
    return out


def _rpc_error(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory):
    """root/bad: 8 small JPEGs of one class, images 2, 3 and 5 corrupt (not validated at conversion)."""
    pytest.importorskip("skimage")
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder

    base = tmp_path_factory.mktemp("bad")
    make_image_folder(base / "src", num_images=8, num_classes=1, mean_size=(64, 48), workers=1)
    for i in BAD:
        (base / "src" / "class_000" / f"img_{i:06d}.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"garbage" * 50)
    convert(str(base / "src"), str(base / "root" / "bad"), ConvertOptions(workers=1, progress=False))
    return base / "root"


@pytest.fixture(scope="module")
def bad_server(bad_root):
    srv, port = create_server([str(bad_root)])
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


# -- the end of an epoch -------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size, world, drop_last, end", [
    (64, 1, False, 256), (100, 1, False, 300), (100, 1, True, 200), (30, 3, False, 270), (30, 3, True, 180),
])
def test_end_position_is_a_field_and_not_num_samples(server, batch_size, world, drop_last, end):
    """feats has 256 samples; the cursor at the end is ceil or floor(N/G)*G, as the proto says."""
    _, address = server
    batches = _stream(address, dataset="feats", batch_size=batch_size, world_size=world, rank=world - 1,
                      drop_last=drop_last)
    assert {h.end_position for h, _, _ in batches} == {end}
    assert batches[-1][1] == end
    # drop_last=false: positions below T = ceil(N/W)*W are read, T - N of them padding from the start
    T = -(-256 // world) * world
    got = sum(len(b["__key__"]) for _, _, b in batches)
    assert got == (T // world if not drop_last else end // world)


def test_padding_repeats_the_first_positions(server):
    """drop_last=false with world 3: T = 258 positions, the 2 padded ones read order[0], order[1]."""
    _, address = server
    keys = [[k for _, _, b in _stream(address, dataset="feats", batch_size=16, world_size=3, rank=r)
             for k in b["__key__"]] for r in range(3)]
    positions = {r + 3 * j: k for r in range(3) for j, k in enumerate(keys[r])}
    assert sorted(positions) == list(range(258))
    assert positions[256] == positions[0] and positions[257] == positions[1]
    assert len({positions[p] for p in range(256)}) == 256


# -- dataset_id, field order, keys ---------------------------------------------------------------
def test_dataset_id_is_the_documented_digest(server):
    _, address = server
    for info in _stub(address).ListDatasets(pb.ListDatasetsRequest(), timeout=10).datasets:
        manifest = json.loads(info.manifest_json)
        digest = hashlib.sha256("".join(s["sha256"] for s in manifest["shards"]).encode("ascii")).hexdigest()
        assert info.dataset_id == digest[:16] and re.fullmatch(r"[0-9a-f]{16}", info.dataset_id)


def test_field_order_is_the_request_order_or_field_names(server):
    _, address = server
    info = _stub(address).ListDatasets(pb.ListDatasetsRequest(name="feats"), timeout=10).datasets[0]
    assert sorted(info.field_names) == sorted(info.fields)
    (h, _, _), *_ = _stream(address, dataset="feats", batch_size=4, max_batches=1)
    assert [f.name for f in h.fields] == list(info.field_names)
    for order in (["npy", "cls"], ["cls", "npy"]):
        (h, _, _), *_ = _stream(address, dataset="feats", batch_size=4, max_batches=1, fields=order)
        assert [f.name for f in h.fields] == order
    kinds = {f.name: (f.layout, f.dtype, list(f.shape)) for f in h.fields}
    assert kinds["cls"] == (pb.FIELD_LAYOUT_TENSOR, "<i8", [4])
    assert kinds["npy"][0] == pb.FIELD_LAYOUT_TENSOR and kinds["npy"][2] == [4, 32, 64]


# -- transforms ----------------------------------------------------------------------------------
def test_unset_transform_fields_take_the_documented_defaults(server, roots):
    """A spec with only `size` (proto3 sends 0 and "" for the rest) is the eval transform with
    resize floor(size*8/7), NCHW float32, no normalization (0..255), as the proto states."""
    from feedkit import local_batches

    from gdsload.decode.image import ImageTransform

    _, address = server
    remote = _stream(address, dataset="imgs", batch_size=8, max_batches=2, fields=["jpg"],
                     payload=pb.PAYLOAD_DECODED, transform=pb.ImageTransformSpec(size=32))
    local = local_batches(roots / "imgs", batch_size=8, fields=["jpg"], decode=True,
                          transform=ImageTransform(size=32, train=False, resize=36, mean=None, std=None))
    for (h, _, a), b in zip(remote, local):
        assert h.fields[0].dtype == "<f4" and list(h.fields[0].shape) == [8, 3, 32, 32]
        assert a["jpg"].max() > 1.5 and a["jpg"].min() >= 0 and a["jpg"].max() <= 255
        np.testing.assert_array_equal(a["jpg"], b[0])  # fields=[...]: a tuple locally
    assert len(remote) == 2


def test_spec_defaults_follow_the_proto():
    spec = imagewire.spec_defaults(pb.ImageTransformSpec(size=224, train=True))
    assert (spec.scale_min, spec.scale_max, spec.ratio_min, spec.ratio_max) == (0.08, 1.0, 0.75, 4 / 3)
    assert (spec.resize, spec.layout, spec.dtype, spec.flip, list(spec.mean)) == (256, "NCHW", "float32", 0.0, [])
    kept = imagewire.spec_defaults(pb.ImageTransformSpec(size=64, resize=80, layout="NHWC", dtype="uint8", scale_min=0.5))
    assert (kept.resize, kept.layout, kept.dtype, kept.scale_min) == (80, "NHWC", "uint8", 0.5)


@pytest.mark.parametrize("payload", [pb.PAYLOAD_RAW, pb.PAYLOAD_UNSPECIFIED])
def test_a_transform_with_raw_payload_is_refused(server, payload):
    _, address = server
    req = pb.BatchRequest(dataset="imgs", batch_size=4, payload=payload, transform=pb.ImageTransformSpec(size=32))
    err = _rpc_error(lambda: next(iter(_stub(address).StreamBatches(req, timeout=10))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "BatchRequest.transform" in err.details() and "PAYLOAD_RAW" in err.details()


def test_plan_errors_name_the_request_fields(server):
    _, address = server
    for req, words in [(pb.BatchRequest(dataset="feats", batch_size=4, start_position=5), "start_position = 5"),
                       (pb.BatchRequest(dataset="feats", batch_size=4, start_position=512), "start_position = 512"),
                       (pb.BatchRequest(dataset="feats", batch_size=4, rank=2, world_size=2), "world_size 2")]:
        err = _rpc_error(lambda: next(iter(_stub(address).StreamBatches(req, timeout=10))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()


# -- skipped samples -----------------------------------------------------------------------------
def test_skipped_samples_are_named_and_an_all_bad_batch_is_sent_empty(bad_server):
    batches = _stream(bad_server, dataset="bad", batch_size=2, payload=pb.PAYLOAD_DECODED,
                      on_error=pb.ON_ERROR_SKIP, transform=pb.ImageTransformSpec(size=16))
    assert [p for _, p, _ in batches] == [2, 4, 6, 8]  # every step arrives, the empty one too
    bad = {f"class_000/img_{i:06d}" for i in BAD}
    for step, (h, _, b) in enumerate(batches):
        expected = [f"class_000/img_{i:06d}" for i in (2 * step, 2 * step + 1)]
        assert list(h.skipped_keys) == [k for k in expected if k in bad]
        assert list(b["__key__"]) == [k for k in expected if k not in bad]
        assert h.skipped == len(h.skipped_keys) and h.num_samples == len(b["__key__"])
    empty = batches[1][0]
    assert empty.num_samples == 0 and list(empty.fields[0].shape)[0] == 0


def test_decode_error_names_the_protocol_field_in_a_whole_sentence(bad_server):
    req = pb.BatchRequest(dataset="bad", batch_size=2, payload=pb.PAYLOAD_DECODED,
                          transform=pb.ImageTransformSpec(size=16))
    err = _rpc_error(lambda: list(_stub(bad_server).StreamBatches(req, timeout=60)))
    assert err.code() == grpc.StatusCode.DATA_LOSS
    details = err.details()
    assert "class_000/img_000002" in details and "BatchRequest.on_error = ON_ERROR_SKIP" in details
    assert "on_error='skip'" not in details
    reason = details.split(": ", 1)[1].split("; set BatchRequest")[0]
    assert "decoders.image failed: " in reason and not reason.rstrip().endswith(","), reason


def test_several_image_fields_name_the_request_fields(tmp_path):
    """A dataset with .jpg and .png per sample: PAYLOAD_DECODED without fields says to pick one in
    BatchRequest.fields (not the Python `fields=[...]`)."""
    import io
    import tarfile

    pytest.importorskip("PIL")
    from PIL import Image

    from gdsload.convert.engine import ConvertOptions, convert

    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "part-0.tar", "w") as tar:
        for i in range(4):
            for ext in ("jpg", "png"):
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), (i, 2 * i, 3 * i)).save(buf, format="JPEG" if ext == "jpg" else "PNG")
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = buf.tell()
                buf.seek(0)
                tar.addfile(info, buf)
    convert(str(src), str(tmp_path / "root" / "two"), ConvertOptions(workers=1, progress=False))
    srv, port = create_server([str(tmp_path / "root")])
    srv.start()
    try:
        req = pb.BatchRequest(dataset="two", batch_size=2, payload=pb.PAYLOAD_DECODED)
        err = _rpc_error(lambda: next(iter(_stub(f"127.0.0.1:{port}").StreamBatches(req, timeout=10))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "BatchRequest.fields" in err.details() and "fields=[" not in err.details()
    finally:
        srv.shutdown(grace_s=1)


# -- auth ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(roots):
    srv, port = create_server([str(roots)], token="tok-123")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


@pytest.mark.parametrize("value", ["Bearer tok-123", "bearer tok-123", "BEARER tok-123", "bEaReR  tok-123"])
def test_bearer_scheme_is_case_insensitive(guarded, value):
    resp = _stub(guarded).GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=(("authorization", value),))
    assert resp.protocol_version == 1


@pytest.mark.parametrize("value", ["Basic tok-123", "Bearer tok-1234", "tok-123", "Bearertok-123"])
def test_other_credentials_are_refused(guarded, value):
    err = _rpc_error(lambda: _stub(guarded).GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                                          metadata=(("authorization", value),)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_missing_token_message_names_the_metadata_not_python(guarded):
    err = _rpc_error(lambda: _stub(guarded).GetServerInfo(pb.GetServerInfoRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer TOKEN" in err.details() and "RemoteLoader(" not in err.details()


# -- the health reference ------------------------------------------------------------------------
def test_the_health_reference_matches_grpc_health():
    """The proto's Health paragraph names the package, service, rpcs and status values that the
    server's grpc.health.v1 implementation really has."""
    from grpc_health.v1 import health_pb2

    text = " ".join(line.lstrip("/ ") for line in PROTO.splitlines() if line.startswith("//"))
    para = text[text.index("Health: the standard gRPC health service"):text.index("Status codes")]
    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert f"package {health_pb2.DESCRIPTOR.package}" in para and "service Health" in para
    assert set(re.findall(r"rpc (\w+)", para)) == {m.name for m in service.methods}
    values = dict(re.findall(r"\b([A-Z_]+) = (\d+)", para))
    enum = health_pb2.HealthCheckResponse.ServingStatus
    assert values and {k: int(v) for k, v in values.items()} == {k: enum.Value(k) for k in enum.keys()}
    assert "grpc/health/v1/health.proto" in para


def test_the_proto_states_the_chunk_minimum(server):
    from gdsload.service.protocol.config import MIN_CHUNK_BYTES

    assert f"at least {MIN_CHUNK_BYTES}" in PROTO
    _, address = server
    req = pb.BatchRequest(dataset="feats", batch_size=4, max_chunk_bytes=MIN_CHUNK_BYTES - 1)
    err = _rpc_error(lambda: next(iter(_stub(address).StreamBatches(req, timeout=10))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and str(MIN_CHUNK_BYTES) in err.details()


# -- echoed values -------------------------------------------------------------------------------
def test_a_huge_dataset_name_is_cut_in_the_message(server):
    """100 KB of name, echoed whole, went past gRPC's 8 KiB metadata limit and the client got an
    unrelated error instead of NOT_FOUND. Messages are cut to 2000 bytes (feed.proto)."""
    _, address = server
    name = "n" * 100_000
    for call in (lambda: _stub(address).ListDatasets(pb.ListDatasetsRequest(name=name), timeout=10),
                 lambda: next(iter(_stub(address).StreamBatches(pb.BatchRequest(dataset=name, batch_size=1),
                                                                timeout=10)))):
        err = _rpc_error(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND, err
        assert "'feats'" in err.details() and "100002 characters" in err.details()
        assert len(err.details().encode()) <= 2000
    req = pb.BatchRequest(dataset="feats", batch_size=4, dataset_id="f" * 100_000)
    err = _rpc_error(lambda: next(iter(_stub(address).StreamBatches(req, timeout=10))))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and len(err.details().encode()) <= 2000


def test_an_epoch_the_wire_cannot_carry_is_a_state_error(server):
    from gdsload.plan.plan import StateError
    from gdsload.service.client import RemoteLoader

    _, address = server
    loader = RemoteLoader(address, dataset="feats", batch_size=8, output="numpy", max_retries=0)
    state = loader.state_dict()
    loader.load_state_dict(dict(state, epoch=2**64 - 1))  # the largest uint64 is fine
    with pytest.raises(StateError, match="epoch"):
        loader.load_state_dict(dict(state, epoch=2**64))
    assert loader.epoch == 2**64 - 1


def test_remote_skip_matches_local_skip(bad_server, bad_root):
    """RemoteLoader with on_error='skip' gives the local loader's batches, the empty one included."""
    from feedkit import assert_same_batches, local_batches

    from gdsload.decode.image import ImageTransform
    from gdsload.service.client import RemoteLoader

    t = ImageTransform(size=16, train=False, resize=18)
    remote = list(RemoteLoader(bad_server, dataset="bad", batch_size=2, decode=True, transform=t,
                               on_error="skip", output="numpy", max_retries=0))
    local = local_batches(bad_root / "bad", batch_size=2, decode=True, transform=t, on_error="skip")
    assert [len(b["__key__"]) for b in remote] == [2, 0, 1, 2]
    assert_same_batches(remote, local)
