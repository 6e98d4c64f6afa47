"""Source datasets for the pass tests, made once per session with PyAV (`mediakit`)."""

from __future__ import annotations

import json
from pathlib import Path

import mediakit as mk
import pytest
from mediakit import VFR_MS

import gdsload


@pytest.fixture(scope="session")
def media_src(tmp_path_factory) -> Path:
    """Six samples in three input shards: `mp4` (H.264 160x90 at 5 fps, AAC stereo unless said)
    and `flac` (a 16 kHz tone). v1's video has a variable frame rate, v3's and v4's have no audio,
    v4's is 320x180."""
    root = tmp_path_factory.mktemp("process") / "src"
    samples = [
        {"__key__": "v0", "mp4": mk.video(3.0), "flac": mk.flac(2.0)},
        {"__key__": "v1", "mp4": mk.video(times_ms=VFR_MS, audio=False, seconds=2.0), "flac": mk.flac(1.0)},
        {"__key__": "v2", "mp4": mk.video(4.0, freq=880.0), "flac": mk.flac(2.5)},
        {"__key__": "v3", "mp4": mk.video(2.0, audio=False), "flac": mk.flac(1.2)},
        {"__key__": "v4", "mp4": mk.video(2.0, width=320, height=180), "flac": mk.flac(0.5)},
        {"__key__": "v5", "mp4": mk.video(3.4), "flac": mk.flac(3.0)},
    ]
    with gdsload.ShardWriter(root, shard_size="160KB") as w:
        for s in samples:
            w.write(s)
    m = json.loads((root / "manifest.json").read_text())
    assert len(m["shards"]) >= 3, [s["samples"] for s in m["shards"]]
    return root
