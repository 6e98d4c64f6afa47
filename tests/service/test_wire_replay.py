"""The feed's wire bytes are those recorded before issue 48's restructure (no byte on the wire
changes: the Node.js clients written from the proto keep working).

`wire_records/records.json.gz` holds request and response bytes of a server of the base commit
(see wire_records/README.md); `tools/record_wire.py` made it. Here the same datasets are rebuilt,
the current server (`gdsload.service.create_server`, a name the restructure keeps) is started on
loopback, every recorded request is sent again as raw bytes (gRPC with identity serializers; the
bulk connection by hand) and each answer must equal the recorded one byte for byte, after the
recorder's normalisations (per-run fields such as the bulk ticket and port, the server version;
`record_wire.normalise` lists them). That covers ListDatasets, GetServerInfo, raw, decoded,
striped, mixed, shared and stored streams, the bulk connection's framing and error statuses with
their details.

When a case fails on purpose (a wire change that is meant), record again from the new base and
say so in the commit; a failure here is otherwise a change in what clients receive.
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("skimage")  # the image dataset's generator (gdsload.sampledata)

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "wire_records" / "records.json.gz"
_spec = importlib.util.spec_from_file_location("record_wire", HERE.parent.parent / "tools" / "record_wire.py")
rw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rw)

RECORDED = rw.load(RECORDS)
CASES = {c["name"]: c for c in RECORDED["cases"]}
_DECODED = {name for name, c in CASES.items() if "PAYLOAD_DECODED" in str(c["request_text"])}


def _has_dali() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def feed(tmp_path_factory):
    """The current server over the rebuilt datasets, and a channel to it."""
    assert RECORDED["server"] == rw.SERVER_KW, "record_wire.SERVER_KW changed since the recording: record again"
    root = rw.build_datasets(tmp_path_factory.mktemp("wire"))
    srv, address = rw.start_server(root)
    try:
        with grpc.insecure_channel(address) as channel:
            ids = rw.dataset_ids(channel)
            assert ids == RECORDED["datasets"], (
                f"the rebuilt datasets differ from the recorded ones ({ids} != {RECORDED['datasets']}): "
                "the shards changed (NumPy / Pillow / scikit-image versions, sampledata or convert), "
                "not the wire; record again (wire_records/README.md) from the base commit")
            yield channel
    finally:
        srv.shutdown(grace_s=2)


def _bulk_messages(recorded: str) -> list:
    """The BatchChunks of one stream's recorded bulk bytes (ACK, framed messages, end marker)."""
    import struct

    from gdsload.v1 import feed_pb2 as pb

    raw = base64.b64decode(recorded)
    assert raw[:1] == b"\x01"
    out, at = [], 1
    while True:
        n, head = struct.unpack_from("<QI", raw, at)
        at += 12
        if n == 0:
            assert at == len(raw) and head == 0
            return out
        out.append(pb.BatchChunk.FromString(raw[at:at + n]))
        at += n


def _first_difference(a: bytes, b: bytes) -> int:
    return next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))


def _explain(method: str, want: list[str], got: list[str]) -> str:
    """Where two lists of base64 messages first differ, with both messages parsed (data cut)."""
    from gdsload.v1 import feed_pb2 as pb

    kind = {"GetServerInfo": pb.ServerInfo, "ListDatasets": pb.ListDatasetsResponse}.get(method, pb.BatchChunk)
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            w, g = base64.b64decode(w), base64.b64decode(g)
            text = []
            for raw in (w, g):
                m = kind.FromString(raw)
                size = len(m.data) if hasattr(m, "data") else 0
                if size:
                    m.data = b""
                text.append(f"{len(raw)} bytes{f', data {size} bytes' if size else ''}:\n{m}")
            return (f"message {i} differs from byte {_first_difference(w, g)} on; recorded {text[0]}\n"
                    f"now {text[1]}")
    return f"{len(got)} messages, recorded {len(want)}"


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_request_gets_the_recorded_bytes(feed, name):
    case = CASES[name]
    if name in _DECODED and not _has_dali():
        pytest.skip("decoding on the server needs NVIDIA DALI")
    got = rw.run_case(feed, "127.0.0.1", case)
    assert (got["code"], got["details"]) == (case["code"], case["details"])
    assert got["responses"] == case["responses"], _explain(case["method"], case["responses"], got["responses"])
    assert len(got["bulk"]) == len(case["bulk"])
    for i, (w, g) in enumerate(zip(case["bulk"], got["bulk"])):
        w, g = base64.b64decode(w), base64.b64decode(g)
        assert g == w, (f"bulk bytes of stream {i}: {len(g)} bytes, recorded {len(w)}; "
                        f"first difference at byte {_first_difference(w, g)}")


def test_the_recording_covers_what_the_issue_names():
    """The recording holds each kind of exchange issue 48 names (so a re-recording cannot
    silently drop one): both unary methods, raw, decoded, a fields subset, striped, max_batches,
    mix, stored over bulk, and error statuses with their details."""
    from gdsload.v1 import feed_pb2 as pb

    reqs = [pb.BatchRequest.FromString(base64.b64decode(r)) for c in CASES.values()
            for r in (c.get("requests") or [c["request"]]) if c["method"] in ("StreamBatches", "bulk")]
    assert {c["method"] for c in CASES.values()} == {"GetServerInfo", "ListDatasets", "StreamBatches", "bulk"}
    assert any(r.payload == pb.PAYLOAD_DECODED for r in reqs)
    assert any(r.fields for r in reqs) and any(r.block_stride > 1 for r in reqs)
    assert any(r.max_batches for r in reqs) and any(r.HasField("mix") for r in reqs)
    assert any(r.bulk and r.checks_item_crc32 for r in reqs)
    # sent as stored: the bulk messages of the imgs streams carry each member's CRC32
    crcs = [f.item_crc32 for c in CASES.values() for b in c["bulk"] for m in _bulk_messages(b)
            if m.HasField("header") for f in m.header.fields if f.name == "jpg"]
    assert crcs and any(crcs) and all(len(x) in (0, 4, 8) for x in crcs)
    errors = {c["code"] for c in CASES.values() if c["code"] != "OK"}
    assert {"NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION"} <= errors
    assert all(c["details"] for c in CASES.values() if c["code"] != "OK")
    assert all(c["responses"] for c in CASES.values() if c["code"] == "OK")
