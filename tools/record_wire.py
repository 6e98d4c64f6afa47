#!/usr/bin/env python
"""Record the feed's wire bytes: gRPC and bulk-connection request/response bytes of a real server.

Issue 48 restructures `gdsload/service/` and must change no byte on the wire. This script, run on
the tree from before that change, starts a real server (`gdsload.service.create_server`, loopback,
port 0) over small deterministic datasets, sends a fixed set of requests as raw bytes (gRPC with
identity serializers: the request bytes go out untouched and the response bytes come back
untouched) and writes what came back to `tests/service/wire_records/records.json.gz`.
`tests/service/test_wire_replay.py` rebuilds the same datasets, replays every recorded request
against the current server with the same functions of this file, and asserts byte equality.

    PYTHONPATH=/tmp/wire_base .venv/bin/python tools/record_wire.py [OUT]

(with /tmp/wire_base made by `git archive BASE | tar -x -C /tmp/wire_base`, so the server that is
recorded is BASE's, whatever the checkout holds; `--check` records twice and fails when the two
recordings differ, i.e. when something in them is not a function of the requests.)

What is recorded, per case (`CASES`): the method, the request bytes, every response message's
bytes, the call's final status code and details; for a stream over the bulk connection also every
byte read on that connection (the ACK, each framed message, the end marker), per ticket.

Normalisations (everything else is compared byte for byte). Each parses the message, clears the
field and serializes again, so the rest of the message is still compared as sent:
- `GetServerInfo`: `version` (the gdsload version string changes with releases, not with the
  wire), `active_streams` and `memory_in_use_bytes` (what other streams hold at that instant:
  parked loaders of earlier cases, a stream still closing), `decode_available` and
  `media_available` (whether this host has DALI / PyAV installed, a fact of the host), and
  `orders` (the order versions served: a field added after the base, which sends none;
  tests/service/test_order_feed.py checks it).
  `max_memory_bytes` is pinned by the server's `Limits` instead (its default is half the host's
  memory).
- `ListDatasets`: serialized again with `deterministic=True`, which only sorts the entries of
  the map `DatasetInfo.fields`: protobuf does not fix the order of map entries on the wire, and
  Python's protobuf writes them in an order that changes from one process to the next (string
  hashing), so two runs of the same server differ there. Every other byte, the manifest JSON
  included, is compared as sent.
- The bulk offer (`BatchChunk.bulk`, first message of a `bulk` stream): `ticket` (16 random
  bytes) and `port` (the bulk listener's free port). The ticket the client writes on the bulk
  socket is that random value too, so it is not recorded; what the server writes back is.
Nothing else varies between runs: the datasets' shards are byte-identical for the same NumPy,
Pillow and scikit-image (`gdsload.sampledata`: every sample seeded by (seed, index); convert with
one worker), and the "created" record of each manifest (time, source path, seconds, input
fingerprint, gdsload version) is pinned to fixed values after converting, so
`DatasetInfo.manifest_json` is too. Decoded images use the evaluation transform only (resize and
center crop: no random draws, so no dependence on the order the decode pool runs batches in).

Layout of the recording (JSON, gzip): {"base": commit, "datasets": {name: dataset_id},
"server": {create_server keyword arguments}, "cases": [{"name", "method", "request" (base64),
"request_text" (for reading only), "responses": [base64...], "code", "details", "bulk":
[base64 of each ticket's bytes]} ...]}. Bulk cases have "requests" (a list) instead of "request":
their streams share one bulk connection in turn, as a striping client's do.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FEED = "/gdsload.v1.Feed/"
#: keyword arguments of create_server besides the roots (pinned: the defaults of some depend on the host)
SERVER_KW: dict[str, Any] = {"max_memory_bytes": 1 << 30, "workers": 1, "prefetch": 2}
#: bytes the bulk connection adds: before each message its length (8 bytes LE) and its head's (4 LE)
_FRAME = struct.Struct("<QI")
TIMEOUT_S = 30.0


# -- datasets ------------------------------------------------------------------------------------
PINNED_CREATED = {"at": "2000-01-01T00:00:00Z", "by": "gdsload (pinned)", "fingerprint": "0" * 64,
                  "seconds": 0.0, "source": "src"}


def build_datasets(base: Path) -> Path:
    """The served root: `imgs` (24 JPEGs of about 64x48 px in 3 classes, 7 shards) and `feats`
    (40 float32 (4, 8) arrays with labels, 5 shards), made by `gdsload.sampledata` with fixed seeds
    and converted with one worker; each manifest's "created" record pinned (`PINNED_CREATED`)."""
    from gdsload.convert.engine import ConvertOptions, convert
    from gdsload.sampledata import make_image_folder, make_npy_folder

    root = base / "root"
    make_image_folder(base / "src-img", num_images=24, num_classes=3, mean_size=(64, 48), workers=1, seed=7)
    convert(str(base / "src-img"), str(root / "imgs"), ConvertOptions(workers=1, progress=False, shard_size=20_000))
    make_npy_folder(base / "src-npy", num_samples=40, shape=(4, 8), dtype="float32", seed=3)
    convert(str(base / "src-npy"), str(root / "feats"), ConvertOptions(workers=1, progress=False, shard_size=16_384))
    for name in ("imgs", "feats"):
        path = root / name / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["created"].update(PINNED_CREATED)
        path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return root


def start_server(root: Path):
    """A server over `root` on loopback port 0, with `SERVER_KW`: (server, address)."""
    from gdsload.service import create_server
    from gdsload.service.protocol.config import Limits

    kw = dict(SERVER_KW)
    srv, port = create_server([str(root)], limits=Limits(max_memory_bytes=kw.pop("max_memory_bytes")), **kw)
    srv.start()
    return srv, f"127.0.0.1:{port}"


# -- the requests --------------------------------------------------------------------------------
def _cases() -> list[dict[str, Any]]:
    """The recorded requests: (name, method, request message or list of them for bulk)."""
    from gdsload.v1 import feed_pb2 as pb

    R = pb.BatchRequest
    RAW, DEC = pb.PAYLOAD_RAW, pb.PAYLOAD_DECODED
    eval_u8 = pb.ImageTransformSpec(size=24, resize=28, layout="NHWC", dtype="uint8")
    eval_f32 = pb.ImageTransformSpec(size=16, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    mix = pb.MixSpec(sources=[pb.MixSource(dataset="feats", weight=1.0), pb.MixSource(dataset="imgs", weight=1.0)],
                     samples_per_epoch=32, mix_by=pb.MIX_BY_SAMPLE)
    c: list[tuple[str, str, Any]] = [
        ("server_info", "GetServerInfo", pb.GetServerInfoRequest()),
        ("list_all", "ListDatasets", pb.ListDatasetsRequest()),
        ("list_one", "ListDatasets", pb.ListDatasetsRequest(name="feats")),
        ("list_unknown", "ListDatasets", pb.ListDatasetsRequest(name="nope")),
        # raw batches
        ("npy_raw", "StreamBatches", R(dataset="feats", batch_size=8, payload=RAW)),
        ("npy_raw_unspecified_payload", "StreamBatches", R(dataset="feats", batch_size=16)),
        ("npy_shuffled_rank1_of_3_padded", "StreamBatches",
         R(dataset="feats", batch_size=4, shuffle=True, seed=11, epoch=2, shuffle_window=2, rank=1, world_size=3,
           payload=RAW)),
        ("npy_drop_last_resume", "StreamBatches",
         R(dataset="feats", batch_size=6, shuffle=True, seed=5, drop_last=True, start_position=12, payload=RAW)),
        ("npy_max_batches", "StreamBatches", R(dataset="feats", batch_size=4, max_batches=3, payload=RAW)),
        ("npy_fields_subset", "StreamBatches", R(dataset="feats", batch_size=8, fields=["cls"], payload=RAW)),
        ("npy_fields_reordered", "StreamBatches", R(dataset="feats", batch_size=8, fields=["npy", "cls"])),
        ("imgs_raw_chunked", "StreamBatches",
         R(dataset="imgs", batch_size=8, shuffle=True, seed=1, max_chunk_bytes=4096, payload=RAW)),
        ("imgs_raw_jpg_only", "StreamBatches", R(dataset="imgs", batch_size=5, fields=["jpg"], payload=RAW)),
        ("imgs_raw_checks_crc_over_grpc", "StreamBatches",
         R(dataset="imgs", batch_size=8, checks_item_crc32=True, payload=RAW)),
        # striped: blocks of 2 steps, every 3rd block, starting inside block 0
        ("npy_striped", "StreamBatches",
         R(dataset="feats", batch_size=2, block_batches=2, block_stride=3, start_position=2, payload=RAW)),
        ("imgs_striped_max_batches", "StreamBatches",
         R(dataset="imgs", batch_size=3, block_batches=1, block_stride=2, max_batches=3, shuffle=True, seed=9)),
        ("share_alone", "StreamBatches", R(dataset="feats", batch_size=8, share="wire-test", payload=RAW)),
        ("mix_raw", "StreamBatches", R(mix=mix, batch_size=8, seed=2, shuffle=True, payload=RAW)),
        # decoded (DALI CPU), evaluation transform only (deterministic)
        ("imgs_decoded_u8_nhwc", "StreamBatches",
         R(dataset="imgs", batch_size=6, payload=DEC, transform=eval_u8, max_batches=2)),
        ("imgs_decoded_f32_nchw_cls", "StreamBatches",
         R(dataset="imgs", batch_size=4, payload=DEC, transform=eval_f32, fields=["cls", "jpg"], max_batches=2,
           max_chunk_bytes=4096)),
        # errors: status code and details
        ("err_unknown_dataset", "StreamBatches", R(dataset="nope", batch_size=8)),
        ("err_bad_rank", "StreamBatches", R(dataset="feats", batch_size=8, rank=2, world_size=2)),
        ("err_unknown_field", "StreamBatches", R(dataset="feats", batch_size=8, fields=["png"])),
        ("err_dataset_id", "StreamBatches", R(dataset="feats", dataset_id="0123456789abcdef", batch_size=8)),
        ("err_position", "StreamBatches", R(dataset="feats", batch_size=8, start_position=3)),
        ("err_transform_raw", "StreamBatches", R(dataset="imgs", batch_size=8, transform=eval_u8, payload=RAW)),
        ("err_chunk_small", "StreamBatches", R(dataset="feats", batch_size=8, max_chunk_bytes=100)),
        ("err_stride_share", "StreamBatches",
         R(dataset="feats", batch_size=8, block_batches=1, block_stride=2, share="x")),
        ("err_batch_size_zero", "StreamBatches", R(dataset="feats")),
        # the bulk connection: streams in turn on one connection
        ("bulk_npy_then_stored", "bulk",
         [R(dataset="feats", batch_size=8, bulk=True, payload=RAW),
          R(dataset="imgs", batch_size=8, bulk=True, checks_item_crc32=True, shuffle=True, seed=3, payload=RAW)]),
        ("bulk_stored_striped_chunked", "bulk",
         [R(dataset="imgs", batch_size=4, bulk=True, checks_item_crc32=True, block_batches=1, block_stride=2,
            max_chunk_bytes=4096, payload=RAW)]),
        ("bulk_decoded", "bulk",
         [R(dataset="imgs", batch_size=6, bulk=True, payload=DEC, transform=eval_u8, max_batches=2)]),
    ]
    out = []
    for name, method, req in c:
        case = {"name": name, "method": method}
        if isinstance(req, list):
            case["requests"] = [base64.b64encode(r.SerializeToString()).decode() for r in req]
            case["request_text"] = [str(r) for r in req]
        else:
            case["request"] = base64.b64encode(req.SerializeToString()).decode()
            case["request_text"] = str(req)
        out.append(case)
    return out


# -- talking raw bytes ---------------------------------------------------------------------------
def normalise(method: str, message: bytes) -> bytes:
    """`message` (a response of a `method` call) with its per-run fields cleared (see the module
    docstring), parsed and serialized again; other messages unchanged."""
    from gdsload.v1 import feed_pb2 as pb

    if method == "ListDatasets" and message:
        # map entries (DatasetInfo.fields) go out in an order protobuf leaves open (it changes
        # with the process's string hashing): serialized again with sorted keys
        return pb.ListDatasetsResponse.FromString(message).SerializeToString(deterministic=True)
    if method == "GetServerInfo":
        info = pb.ServerInfo.FromString(message)
        # per-run fields, then fields later issues added under the proto's rule (absent at the base):
        # `orders` (issue 50), `serves_windows` (issue 54)
        for name in ("version", "active_streams", "memory_in_use_bytes", "decode_available", "media_available",
                     "orders", "serves_windows"):
            if name in info.DESCRIPTOR.fields_by_name:
                info.ClearField(name)
        return info.SerializeToString()
    if method == "bulk":
        chunk = pb.BatchChunk.FromString(message)
        if chunk.HasField("bulk"):  # the offer, each stream's first message
            chunk.bulk.ClearField("ticket")
            chunk.bulk.ClearField("port")
            return chunk.SerializeToString()
    return message


def _call(channel, method: str, request: bytes) -> tuple[list[bytes], str, str]:
    """Responses (as bytes), final status code name and details of one call."""
    import grpc

    responses: list[bytes] = []
    try:
        if method == "StreamBatches":
            call = channel.unary_stream(FEED + method, request_serializer=None, response_deserializer=None)(
                request, timeout=TIMEOUT_S)
            for message in call:
                responses.append(message)
        else:
            responses.append(channel.unary_unary(FEED + method, request_serializer=None,
                                                 response_deserializer=None)(request, timeout=TIMEOUT_S))
        return responses, "OK", ""
    except grpc.RpcError as exc:
        return responses, exc.code().name, exc.details() or ""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError(f"the bulk connection ended {n - len(buf)} bytes short")
        buf += got
    return bytes(buf)


def _read_bulk(sock: socket.socket) -> bytes:
    """Every byte the server writes for one ticket: the ACK, each framed message, the end marker."""
    out = bytearray(_recv_exact(sock, 1))
    while True:
        head = _recv_exact(sock, _FRAME.size)
        out += head
        n, _ = _FRAME.unpack(head)
        if n == 0:
            return bytes(out)
        out += _recv_exact(sock, n)


def _bulk(channel, host: str, requests: list[bytes]) -> tuple[list[bytes], str, str, list[bytes]]:
    """Streams in turn, each over the same bulk connection (opened on the first offer): the gRPC
    messages of all of them, the last status, and the bytes read on the connection per ticket."""
    import grpc

    from gdsload.v1 import feed_pb2 as pb

    sock: socket.socket | None = None
    responses: list[bytes] = []
    on_socket: list[bytes] = []
    code, details = "OK", ""
    try:
        for request in requests:
            call = channel.unary_stream(FEED + "StreamBatches", request_serializer=None,
                                        response_deserializer=None)(request, timeout=TIMEOUT_S)
            try:
                offer = next(call)
                responses.append(offer)
                bulk = pb.BatchChunk.FromString(offer).bulk
                if sock is None:
                    sock = socket.create_connection((host, bulk.port), timeout=TIMEOUT_S)
                sock.sendall(bulk.ticket)
                on_socket.append(_read_bulk(sock))
                responses.extend(call)  # nothing more on the call: its status
                code, details = "OK", ""
            except grpc.RpcError as exc:
                code, details = exc.code().name, exc.details() or ""
                break
    finally:
        if sock is not None:
            sock.close()
    return responses, code, details, on_socket


def run_case(channel, host: str, case: dict[str, Any]) -> dict[str, Any]:
    """What the server answers to `case`'s recorded request bytes, normalised, as recorded."""
    method = case["method"]
    if method == "bulk":
        requests = [base64.b64decode(r) for r in case["requests"]]
        responses, code, details, on_socket = _bulk(channel, host, requests)
    else:
        responses, code, details = _call(channel, method, base64.b64decode(case["request"]))
        on_socket = []
    responses = [normalise(method, m) for m in responses]
    return {"responses": [base64.b64encode(m).decode() for m in responses], "code": code, "details": details,
            "bulk": [base64.b64encode(b).decode() for b in on_socket]}


def dataset_ids(channel) -> dict[str, str]:
    from gdsload.v1 import feed_pb2 as pb

    raw, _, _ = _call(channel, "ListDatasets", pb.ListDatasetsRequest().SerializeToString())
    return {d.name: d.dataset_id for d in pb.ListDatasetsResponse.FromString(raw[0]).datasets}


def record(workdir: Path) -> dict[str, Any]:
    import grpc

    root = build_datasets(workdir)
    srv, address = start_server(root)
    try:
        with grpc.insecure_channel(address) as channel:
            cases = []
            for case in _cases():
                cases.append({**case, **run_case(channel, "127.0.0.1", case)})
            return {"datasets": dataset_ids(channel), "server": SERVER_KW, "cases": cases}
    finally:
        srv.shutdown(grace_s=2)


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _base_commit() -> str:
    import gdsload

    here = Path(gdsload.__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"(not a git checkout: gdsload from {here})"


def main(argv: list[str] | None = None) -> int:
    default = Path(__file__).resolve().parent.parent / "tests" / "service" / "wire_records" / "records.json.gz"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, default=default)
    ap.add_argument("--base", default=None, help="the commit the recorded gdsload is (stored in the recording)")
    ap.add_argument("--check", action="store_true", help="record twice and fail when they differ")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wire-") as tmp:
        rec = record(Path(tmp) / "a")
        if args.check:
            again = record(Path(tmp) / "b")
            bad = [a["name"] for a, b in zip(rec["cases"], again["cases"]) if a != b]
            if bad or rec["datasets"] != again["datasets"]:
                print(f"two recordings differ: {bad or 'datasets'}", file=sys.stderr)
                return 1
    rec = {"base": args.base or _base_commit(), **rec}
    for case in rec["cases"]:
        grpc_bytes = sum(len(base64.b64decode(m)) for m in case["responses"])
        bulk_bytes = sum(len(base64.b64decode(b)) for b in case["bulk"])
        print(f"{case['name']:34} {case['code']:20} {len(case['responses']):3} messages {grpc_bytes:8} B"
              + (f", bulk {bulk_bytes} B" if case["bulk"] else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:  # mtime 0: the same recording, the same file
        f.write(json.dumps(rec, indent=1).encode())
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
