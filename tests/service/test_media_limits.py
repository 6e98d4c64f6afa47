"""The feed server decodes media within its own limits and counts audio decoding in its memory
budget (issue 46 row 2).

A client's `max_seconds` / `max_pixels` / `max_frames` of None is sent as 0, which the server
reads as its own limit (3600 s, 4K UHD, 100,000 frames), never as "unlimited"; a value over the
server's is INVALID_ARGUMENT naming both. A real server on loopback port 0; a 1 h recording at
1 kHz and one 3856 x 2176 frame are cheap to make and refused from the index, before decoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("nvidia.dali")
pytest.importorskip("grpc")

import gdsload
from gdsload.bench import mediagen as mg
from gdsload.convert.shards import DatasetWriter
from gdsload.decode.audio import AudioTransform
from gdsload.decode.video import VideoTransform
from gdsload.errors import RemoteError
from gdsload.service.protocol import mediawire
from gdsload.service.server import create_server
from gdsload.v1 import feed_pb2 as pb


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    """root/huge: a 3601 s FLAC (1 kHz) and a 3856 x 2176 MJPEG frame, beside a 2 s recording
    and a small frame; root/speech: 8 recordings of 12 s at 16 kHz."""
    root = tmp_path_factory.mktemp("media") / "root"
    with DatasetWriter(root / "huge") as w:
        w.write("big", {"flac": mg.encode_audio("flac", seconds=3601, sample_rate=1000, freq=50),
                        "avi": mg.encode_video("mjpeg", frames=1, width=3856, height=2176)})
        w.write("small", {"flac": mg.encode_audio("flac", seconds=2, sample_rate=1000, freq=50),
                          "avi": mg.encode_video("mjpeg", frames=1, width=64, height=48)})
    with DatasetWriter(root / "speech") as w:
        for i in range(8):
            w.write(f"s{i}", {"flac": mg.encode_audio("flac", seconds=12, sample_rate=16000, freq=200 + 50 * i)})
    return root


@pytest.fixture(scope="module")
def feed(media_root: Path):
    srv, port = create_server([str(media_root)])
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


def _load(address: str, field: str, t, **kw) -> list[dict]:
    return list(gdsload.RemoteLoader(address, dataset="huge", batch_size=2, output="numpy", fields=[field, "__key__"],
                                     transform={field: t}, max_retries=0, **kw))


def test_none_or_zero_is_the_servers_limit_not_unlimited(feed: str) -> None:
    """max_seconds=None and max_pixels=None (sent as 0) decode within the server's limits: the
    1 h recording and the frame over 4K are refused, naming the limit, as a local loader with
    the default limits refuses them; without the fix the server decoded them."""
    for field, t, limit in (("flac", AudioTransform(seconds=1.0, max_seconds=None), "3600"),
                            ("avi", VideoTransform(frames=1, size=16, max_pixels=None), "8294400")):
        with pytest.raises(RemoteError) as e:
            _load(feed, field, t)
        assert e.value.code == "DATA_LOSS" and "big" in str(e.value), e.value
        assert f"over the limit of {limit}" in str(e.value), e.value
        (b,) = _load(feed, field, t, on_error="skip")  # the skip policy still applies
        assert b[1] == ["small"], b[1]


def test_over_the_servers_limit_is_invalid_argument(feed: str) -> None:
    for field, t, words in (("flac", AudioTransform(seconds=1.0, max_seconds=7200.0), "max_seconds=7200"),
                            ("avi", VideoTransform(frames=1, size=16, max_pixels=8294401), "max_pixels=8294401"),
                            ("avi", VideoTransform(frames=1, size=16, max_frames=100_001), "max_frames=100001")):
        with pytest.raises(RemoteError) as e:
            _load(feed, field, t)
        assert e.value.code == "INVALID_ARGUMENT", e.value
        assert words in str(e.value) and "over this server's limit" in str(e.value), e.value


def test_a_lower_limit_is_the_clients() -> None:
    """from_specs (what the server runs on each request): unset and 0 are the server's limits, a
    lower value is kept, a higher one refused; the server's limits are a parameter."""
    limits = mediawire.MediaLimits(max_seconds=60.0, max_pixels=1000, max_frames=50)
    kinds = {"flac": "audio", "mp4": "video"}

    def build(audio: dict, video: dict) -> dict:
        specs = [pb.MediaTransformSpec(field="flac", audio=pb.AudioTransformSpec(**audio)),
                 pb.MediaTransformSpec(field="mp4", video=pb.VideoTransformSpec(**video))]
        return mediawire.from_specs(specs, kinds, limits)

    for sent in ({}, {"max_seconds": 0.0, "max_pixels": 0, "max_frames": 0}):
        got = build({"max_seconds": sent["max_seconds"]} if sent else {},
                    {k: sent[k] for k in ("max_pixels", "max_frames")} if sent else {})
        assert (got["flac"].max_seconds, got["mp4"].max_pixels, got["mp4"].max_frames) == (60.0, 1000, 50)
    got = build({"max_seconds": 30.0}, {"max_pixels": 999, "max_frames": 7})
    assert (got["flac"].max_seconds, got["mp4"].max_pixels, got["mp4"].max_frames) == (30.0, 999, 7)
    with pytest.raises(mediawire.BadRequest, match=r"field 'mp4': max_frames=51 is over this server's limit of 50"):
        build({}, {"max_frames": 51})
    with pytest.raises(mediawire.BadRequest, match=r"field 'flac': max_seconds=-1.0 must be positive"):
        build({"max_seconds": -1.0}, {})
    # the client side: None is sent as 0, the default is not sent (both the server's limit)
    (spec,) = mediawire.to_specs([("flac", AudioTransform(max_seconds=None))])
    assert spec.audio.HasField("max_seconds") and spec.audio.max_seconds == 0


def test_the_memory_budget_counts_audio_decoding(media_root: Path) -> None:
    """10 s crops of 12 s recordings, batch 8: the ring and buffers need ~31 MB, decoding up to
    45 MB more (`decode_nbytes`). A 50 MB budget refuses the stream (it accepted it before audio
    decoding was counted); 200 MB serves it, batches as the local loader's."""
    from gdsload.service.config import Limits

    t = AudioTransform(seconds=10.0)
    assert mediawire.decode_nbytes({"flac": t}, 8) == 8 * 2 * 4 * (160000 + 16000) * 4
    kw = dict(dataset="speech", batch_size=8, shuffle=False, output="numpy", transform={"flac": t}, max_retries=0)
    srv, port = create_server([str(media_root)], limits=Limits(max_memory_bytes=50 << 20))
    srv.start()
    try:
        with pytest.raises(RemoteError) as e:
            list(gdsload.RemoteLoader(f"127.0.0.1:{port}", **kw))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-memory" in str(e.value), e.value
    finally:
        srv.shutdown(grace_s=2)
    srv, port = create_server([str(media_root)], limits=Limits(max_memory_bytes=200 << 20))
    srv.start()
    try:
        (remote,) = list(gdsload.RemoteLoader(f"127.0.0.1:{port}", **kw))
    finally:
        srv.shutdown(grace_s=2)
    (local,) = list(gdsload.DataLoader(str(media_root / "speech"), batch_size=8, shuffle=False, output="numpy",
                                       transform={"flac": t}))
    np.testing.assert_array_equal(remote["flac"], local["flac"])
    assert remote["flac.length"].tolist() == [160000] * 8
