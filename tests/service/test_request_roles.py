"""Every `BatchRequest` field has a role (`protocol.request.ROLE`: identity, range or delivery),
checked against the generated descriptor, so a field added to the proto without one fails here
(shown with a descriptor that has a planted extra field). `identity_key` (the key of parked
loaders and share groups) changes with every identity field and with no other; the combination
rules (`check_combination`, `stored_refusal`, `offers_bulk`) answer as documented."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FieldDescriptor as F

from gdsload.errors import BadRequest
from gdsload.service.protocol import request
from gdsload.service.protocol.request import DELIVERY, IDENTITY, RANGE, ROLE
from gdsload.v1 import feed_pb2 as pb


def test_every_field_of_the_generated_request_has_a_role():
    assert request.unclassified() == []
    assert set(ROLE.values()) == {IDENTITY, RANGE, DELIVERY}
    assert len(ROLE) == len(pb.BatchRequest.DESCRIPTOR.fields)


def _with_planted_field() -> object:
    """BatchRequest as feed.proto declares it, plus `planted = 999`, in a pool of its own."""
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    msg = next(m for m in file.message_type if m.name == "BatchRequest")
    msg.field.add(name="planted", number=999, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    for dep in pb.DESCRIPTOR.dependencies:
        dep_proto = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(dep_proto)
        pool.Add(dep_proto)
    return pool.Add(file).message_types_by_name["BatchRequest"]


def test_a_planted_field_without_a_role_is_found():
    assert request.unclassified(_with_planted_field()) == ["planted"]


def test_a_role_of_a_field_that_is_gone_is_found(monkeypatch):
    monkeypatch.setitem(ROLE, "gone", DELIVERY)
    assert request.unclassified() == ["gone (no such field)"]


def _set(req: pb.BatchRequest, fd) -> None:
    """Give field `fd` of `req` a value that is not its default."""
    name = fd.name
    if fd.is_repeated:
        if fd.type == F.TYPE_MESSAGE:
            getattr(req, name).add()
        else:
            getattr(req, name).append("x" if fd.type == F.TYPE_STRING else 1)
    elif fd.type == F.TYPE_MESSAGE:
        getattr(req, name).SetInParent()
    elif fd.type == F.TYPE_STRING:
        setattr(req, name, "x")
    elif fd.type == F.TYPE_BOOL:
        setattr(req, name, True)
    else:  # integers and enums
        setattr(req, name, 1)


@pytest.mark.parametrize("name", sorted(ROLE))
def test_identity_key_changes_with_identity_fields_only(name):
    base = pb.BatchRequest(dataset="feats", batch_size=4)
    changed = pb.BatchRequest()
    changed.CopyFrom(base)
    _set(changed, pb.BatchRequest.DESCRIPTOR.fields_by_name[name])
    assert changed.SerializeToString() != base.SerializeToString()
    same = request.identity_key(changed) == request.identity_key(base)
    assert same == (ROLE[name] is not IDENTITY), (name, ROLE[name])


def test_identity_key_does_not_change_the_request():
    req = pb.BatchRequest(dataset="feats", batch_size=4, epoch=3, start_position=8, bulk=True, share="g")
    before = req.SerializeToString()
    request.identity_key(req)
    assert req.SerializeToString() == before


def test_check_combination():
    request.check_combination(pb.BatchRequest(block_batches=2, block_stride=3))
    request.check_combination(pb.BatchRequest(share="g", block_batches=2, block_stride=1))
    for bad in (dict(block_stride=2), dict(block_stride=2, block_batches=2, share="g")):
        with pytest.raises(BadRequest, match="block_stride needs block_batches >= 1 and no share name"):
            request.check_combination(pb.BatchRequest(**bad))
    with pytest.raises(BadRequest, match=r"share 'xxxx.*\.\.\. \(200 characters\)"):
        request.check_combination(pb.BatchRequest(block_stride=2, block_batches=1, share="x" * 200))


@pytest.mark.parametrize("kw, bulk, why", [
    (dict(checks_item_crc32=True), True, None),
    (dict(checks_item_crc32=True), False, "not on a bulk connection"),
    (dict(checks_item_crc32=False), True, "CRC32"),
    (dict(checks_item_crc32=True, payload=pb.PAYLOAD_DECODED), True, "decoded"),
    (dict(checks_item_crc32=True, share="g"), True, "shared"),
    (dict(checks_item_crc32=True, mix=pb.MixSpec(sources=[pb.MixSource(dataset="a")])), True, "mix"),
    (dict(checks_item_crc32=True, media=[pb.MediaTransformSpec(field="mp4")]), True, "media"),
])
def test_stored_refusal(kw, bulk, why):
    got = request.stored_refusal(pb.BatchRequest(dataset="imgs", **kw), bulk=bulk)
    assert got is None if why is None else why in got


def test_offers_bulk():
    assert request.offers_bulk(wanted=True, tls=False, address="127.0.0.1:0")
    assert request.offers_bulk(wanted=True, tls=False, address="unix:/tmp/feed.sock")
    assert not request.offers_bulk(wanted=False, tls=False, address="127.0.0.1:0")
    assert not request.offers_bulk(wanted=True, tls=True, address="127.0.0.1:0")
    assert not request.offers_bulk(wanted=True, tls=False, address="unix-abstract:feed")
