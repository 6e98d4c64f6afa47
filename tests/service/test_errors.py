"""Statuses: bad or missing token, unknown dataset, requests over the limits, malformed requests,
a changed dataset, an unreachable server. Health needs no token."""

from __future__ import annotations

import grpc
import pytest
from feedkit import health_status
from grpc_health.v1 import health_pb2

from gdsload.errors import GdsloadError
from gdsload.plan.plan import StateError
from gdsload.service.client import RemoteLoader
from gdsload.service.protocol.config import Limits
from gdsload.service.server import create_server
from gdsload.service.protocol.status import RemoteError
from gdsload.v1 import feed_pb2 as pb
from gdsload.v1 import feed_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def guarded(roots):
    srv, port = create_server([str(roots)], token="s3cret-token", limits=Limits(max_batch_size=64))
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=1)


def _raw(address, **kw):
    return RemoteLoader(address, dataset="feats", output="numpy", max_retries=0, **kw)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_bad_token_is_unauthenticated(guarded, token):
    with pytest.raises(RemoteError) as e:
        len(_raw(guarded, token=token))
    assert e.value.code == "UNAUTHENTICATED"
    assert ("Bearer" in str(e.value)) if token is None else ("wrong" in str(e.value))


def test_bad_token_on_the_stream_too(guarded):
    stub = pb_grpc.FeedStub(grpc.insecure_channel(guarded))
    call = stub.StreamBatches(pb.BatchRequest(dataset="feats", batch_size=4), timeout=5,
                              metadata=(("authorization", "Bearer nope"),))
    with pytest.raises(grpc.RpcError) as e:
        next(iter(call))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_good_token_and_health_without_token(guarded):
    loader = _raw(guarded, token="s3cret-token", batch_size=64)
    assert sum(len(b["__key__"]) for b in loader) == 256
    assert health_status(guarded) == health_pb2.HealthCheckResponse.SERVING


def test_unknown_dataset_is_not_found_naming_it(server):
    _, address = server
    with pytest.raises(RemoteError) as e:
        len(RemoteLoader(address, dataset="no-such-set", max_retries=0))
    assert e.value.code == "NOT_FOUND"
    assert "'no-such-set'" in str(e.value) and "'feats'" in str(e.value)
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as e2:
        next(iter(stub.StreamBatches(pb.BatchRequest(dataset="nope", batch_size=1), timeout=5)))
    assert e2.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e2.value.details()


def test_over_the_limits_is_resource_exhausted(guarded):
    with pytest.raises(RemoteError) as e:
        list(_raw(guarded, token="s3cret-token", batch_size=65))
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert "batch_size 65" in str(e.value) and "limit of 64" in str(e.value)


def test_batch_bytes_and_image_side_limits(roots):
    from gdsload.decode.image import ImageTransform

    srv, port = create_server([str(roots)], limits=Limits(max_batch_bytes=100_000))
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        with pytest.raises(RemoteError) as e:
            list(RemoteLoader(address, dataset="feats", batch_size=64, max_retries=0))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "limit of 100000 bytes" in str(e.value)
        with pytest.raises(RemoteError) as e:
            list(RemoteLoader(address, dataset="imgs", batch_size=1, decode=True, max_retries=0,
                              transform=ImageTransform(size=5000, train=False, resize=5000)))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "5000" in str(e.value)
    finally:
        srv.shutdown(grace_s=1)


def test_malformed_requests_are_invalid_argument(server):
    _, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    cases = {
        "rank": pb.BatchRequest(dataset="feats", batch_size=4, rank=3, world_size=2),
        "multiple of the global batch": pb.BatchRequest(dataset="feats", batch_size=4, start_position=5),
        "batch_size must be >= 1": pb.BatchRequest(dataset="feats"),
        "['nope']": pb.BatchRequest(dataset="feats", batch_size=4, fields=["nope"]),
        "layout": pb.BatchRequest(dataset="imgs", batch_size=4, payload=pb.PAYLOAD_DECODED,
                                  transform=pb.ImageTransformSpec(size=8, resize=8, layout="CHW", dtype="uint8")),
    }
    for words, req in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.StreamBatches(req, timeout=10)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, e.value)
        assert words in e.value.details(), (words, e.value.details())


def test_changed_dataset_is_failed_precondition(server):
    _, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    req = pb.BatchRequest(dataset="feats", batch_size=4, dataset_id="0123456789abcdef")
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stub.StreamBatches(req, timeout=10)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rewritten" in e.value.details()


def test_state_of_another_dataset_is_refused(server):
    _, address = server
    imgs = RemoteLoader(address, dataset="imgs", batch_size=8)
    feats = RemoteLoader(address, dataset="feats", batch_size=8)
    with pytest.raises(StateError, match="dataset"):
        feats.load_state_dict(imgs.state_dict())


def test_user_fn_cannot_travel():
    from gdsload.decode.image import ImageTransform

    with pytest.raises(GdsloadError, match="user_fn"):
        RemoteLoader("127.0.0.1:1", dataset="x", transform=ImageTransform(user_fn=lambda x: x))


def test_unreachable_server_gives_up_with_a_clear_error():
    from feedkit import free_port

    loader = RemoteLoader(f"127.0.0.1:{free_port()}", dataset="feats", max_retries=2, backoff_s=0.01,
                          deadline_s=2)
    with pytest.raises(RemoteError) as e:
        len(loader)
    assert e.value.code == "UNAVAILABLE"


@pytest.mark.parametrize("stripe", [False, True])
def test_failover_to_the_next_address(server, stripe):
    from feedkit import free_port

    _, address = server
    dead = f"127.0.0.1:{free_port()}"
    loader = RemoteLoader([dead, address], dataset="feats", batch_size=64, rank=0, world_size=1,
                          backoff_s=0.01, output="numpy", stripe=stripe)
    assert sum(len(b["__key__"]) for b in loader) == 256
    servers = loader.stats()["servers"]
    assert servers[dead]["failures"] >= 1 and servers[dead]["batches"] == 0
    assert servers[address]["batches"] == 4
    if not stripe:  # one server at a time: the dead one is left for the next
        assert loader.stats()["address"] == address and loader.stats()["reconnects"] >= 1


def test_a_striped_stream_from_the_end_of_the_epoch_is_empty(server):
    """Issue 46 row 8: a `block_stride` request whose start is the end of the epoch (no block of
    its stripe is left) is an empty stream with status OK (it was INTERNAL: an AttributeError)."""
    _, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    for start in (256, 248):  # the end of the epoch (64 steps of 4 samples); its last step
        call = stub.StreamBatches(pb.BatchRequest(dataset="feats", batch_size=4, block_stride=2, block_batches=1,
                                                  start_position=start), timeout=10)
        chunks = list(call)
        assert call.code() == grpc.StatusCode.OK
        assert len(chunks) == (0 if start == 256 else 1)


@pytest.mark.parametrize("field, req", [
    ("BatchRequest.media[0].video.scale_min", pb.BatchRequest(
        dataset="feats", batch_size=4, payload=pb.PAYLOAD_DECODED,
        media=[pb.MediaTransformSpec(video=pb.VideoTransformSpec(scale_min=float("nan"), scale_max=1.0))])),
    ("BatchRequest.media[0].audio.seconds", pb.BatchRequest(
        dataset="feats", batch_size=4, payload=pb.PAYLOAD_DECODED,
        media=[pb.MediaTransformSpec(field="wav", audio=pb.AudioTransformSpec(seconds=float("inf")))])),
    ("BatchRequest.transform.mean[1]", pb.BatchRequest(
        dataset="imgs", batch_size=4, payload=pb.PAYLOAD_DECODED,
        transform=pb.ImageTransformSpec(size=8, resize=8, mean=[0.5, float("nan"), 0.5], std=[1, 1, 1]))),
    ("BatchRequest.transform.flip", pb.BatchRequest(
        dataset="imgs", batch_size=4, payload=pb.PAYLOAD_DECODED,
        transform=pb.ImageTransformSpec(size=8, resize=8, flip=float("-inf")))),
    ("BatchRequest.mix.sources[1].weight", pb.BatchRequest(
        batch_size=4, mix=pb.MixSpec(sources=[pb.MixSource(dataset="feats", weight=1.0),
                                              pb.MixSource(dataset="imgs", weight=float("nan"))]))),
])
def test_nan_or_inf_in_a_request_is_invalid_argument_naming_the_field(server, field, req):
    """Issue 46 row 8: any float field of a request that is NaN or infinite is refused before
    anything is built (a NaN video scale was accepted: it passes every range check)."""
    _, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stub.StreamBatches(req, timeout=10)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details() and "finite" in e.value.details(), e.value.details()
