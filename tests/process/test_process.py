"""`gdsload.process`: the batch layouts, the frame and speech rules, outputs, errors, workers.

Media are made in the session fixture (`conftest.media_src`: H.264 with AAC, a variable frame
rate one, videos without audio, FLAC). A decoded frame names its source frame by its grey level
(`mediakit.frame_of`), so the frame picked for each sampling time is checked exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mediakit as mk
import numpy as np
import passfns
import pytest
from mediakit import VFR_MS, assert_same_output

import gdsload
from gdsload.errors import DecodeError, DestinationError, InputError
from gdsload.decode import passmedia as pmedia
from gdsload.preprocess.unit import FnError


class Recorder:
    """An fn that keeps every batch it was given and returns None (no outputs) or `out(b)`."""

    def __init__(self, out=None):
        self.batches: list[dict] = []
        self.out = out

    def __call__(self, b):
        self.batches.append(b)
        return self.out(b) if self.out else [{"w.json": int(w)} for w in b["window"]]


def _windows(batches):
    return [(k, f, int(w)) for b in batches for k, f, w in zip(b["__key__"], b["field"], b["window"])]


def test_frames_batch_layout_and_the_frame_rule(media_src: Path, tmp_path: Path) -> None:
    """Batch dict: keys, dtypes, shapes; frame k is the last shown at or before k/fps (a constant
    and a variable frame rate); padding: t = -1 and zero frames; (key, field, window) order;
    batches cut at batch_size and where the frame shape changes; size resizes the short side."""
    rec = Recorder()
    r = gdsload.process(media_src, tmp_path / "out", rec, frames=(2.5, 4), batch_size=3, size=45)
    b = rec.batches[0]
    assert set(b) == {"__key__", "field", "window", "frames", "t"}
    assert b["frames"].dtype == np.uint8 and b["t"].dtype == np.float64 and b["window"].dtype == np.int64
    assert b["frames"].shape[1:] == (4, 45, 80, 3)  # 160x90: short side 90 -> 45
    assert all(isinstance(k, str) for k in b["__key__"]) and b["field"] == ["mp4"] * len(b["__key__"])
    seen = _windows(rec.batches)
    assert seen == sorted(seen, key=lambda x: (int(x[0][1:]), x[2]))
    assert all(len(b["window"]) <= 3 for b in rec.batches)
    v4 = [b for b in rec.batches if "v4" in b["__key__"]]
    assert v4[0]["frames"].shape[2:4] == (45, 80) and len(v4) == 1  # 320x180 resized too, batched with v3/v5
    per = {}
    for b in rec.batches:
        for k, w, fr, t in zip(b["__key__"], b["window"], b["frames"], b["t"]):
            per.setdefault(k, []).append((int(w), fr, t))
    # v0: 3.0 s at 5 fps, sampled at 2.5 fps: t = 0, 0.4, ..., 2.8 -> frames 0, 2, 4, ..., 14; 8 samples
    ts = np.concatenate([t for _, _, t in per["v0"]])
    np.testing.assert_allclose(ts[:8], np.arange(8) * 0.4)
    assert len(ts) == 8 and len(per["v0"]) == 2
    assert [mk.frame_of(f.mean()) for _, fr, _ in per["v0"] for f in fr] == [0, 2, 4, 6, 8, 10, 12, 14]
    # v2: 4.0 s: 10 samples, the third window holds 2 and 2 of padding (t = -1, zero frames)
    w2, fr2, t2 = per["v2"][2]
    assert w2 == 2 and list(t2) == [3.2, 3.6, -1, -1] and fr2[2:].max() == 0 and fr2[:2].min() > 0
    assert [mk.frame_of(f.mean()) for f in fr2[:2]] == [16 % 20, 18 % 20]
    # v1 (variable rate, frames shown from 0, .1, .5, .6, 1.5, 1.7 s, the last for 0.2 s): samples
    # at 0, .4, .8, 1.2, 1.6 (< 1.9): the last frame shown at or before each
    vfr = [mk.frame_of(f.mean()) for _, fr, t in per["v1"] for f, x in zip(fr, t) if x >= 0]
    want = [max(i for i, ms in enumerate(VFR_MS) if ms <= 400 * k) for k in range(5)]
    assert vfr == want == [0, 1, 3, 3, 4]
    assert r["windows"] == sum(len(v) for v in per.values()) and r["members"] == 6 and r["outputs"] == r["windows"]
    # frames as decoded (size=None): a batch is cut where the frame shape changes (v4 is 320x180)
    raw = Recorder()
    gdsload.process(media_src, tmp_path / "raw", raw, frames=(2.5, 4), batch_size=3)
    assert all(len({f.shape for f in b["frames"]}) == 1 for b in raw.batches)
    v4 = [b for b in raw.batches if "v4" in b["__key__"]]
    assert [set(b["__key__"]) for b in v4] == [{"v4"}] and v4[0]["frames"].shape[2:4] == (180, 320)
    assert _windows(raw.batches) == seen


def test_speech_chunks_from_audio_and_video_fields(media_src: Path, tmp_path: Path) -> None:
    """Speech: float32 (N, 16 kHz x chunk) mono, `length` valid samples (zeros after), `t` the
    chunk's start from the container's start; from every audio and every video field; a video
    without audio gives no windows and is counted, not rejected."""
    rec = Recorder()
    r = gdsload.process(media_src, tmp_path / "out", rec, speech=1.0, batch_size=4)
    b = rec.batches[0]
    assert set(b) == {"__key__", "field", "window", "audio", "length", "t"}
    assert b["audio"].dtype == np.float32 and b["audio"].shape[1] == 16000 and b["length"].dtype == np.int64
    chunks = {}
    for b in rec.batches:
        for k, f, w, a, n, t in zip(b["__key__"], b["field"], b["window"], b["audio"], b["length"], b["t"]):
            chunks.setdefault((k, f), []).append((int(w), a, int(n), float(t)))
            assert t == int(w) * 1.0 and (a[n:] == 0).all()
    flac = chunks[("v2", "flac")]  # 2.5 s: two full chunks and 8,000 samples
    assert [(w, n) for w, _, n, _ in flac] == [(0, 16000), (1, 16000), (2, 8000)]
    assert 0.2 < np.abs(flac[0][1]).max() < 0.5
    assert ("v3", "mp4") not in chunks and ("v1", "mp4") not in chunks  # no audio stream
    assert len(chunks[("v0", "mp4")]) >= 3 and np.abs(chunks[("v0", "mp4")][1][1]).max() > 0.2
    assert r["fields_without_stream"] == 2 and r["rejected"] == 0
    assert not (tmp_path / "out" / "rejected.jsonl").exists()
    only = Recorder()
    gdsload.process(media_src, tmp_path / "flac", only, speech=2.0, fields=["flac"])
    assert {f for b in only.batches for f in b["field"]} == {"flac"}


def test_output_keys_fields_rule_and_fn_errors(media_src: Path, tmp_path: Path) -> None:
    """Default keys `{key}/{field}/{window:06d}` (`/{j}` for a list), None writes nothing, the
    first output's fields are the pass's; fn's errors name the batch's first and last windows."""
    def fan(b):
        return [None if w % 2 else [{"a.json": 1}, {"a.json": 2}] for w in b["window"]]

    gdsload.process(media_src, tmp_path / "fan", fan, frames=(1.0, 2), batch_size=4)
    keys = gdsload.open_dataset(tmp_path / "fan").keys()
    assert keys[:4] == ["v0/mp4/000000/0", "v0/mp4/000000/1", "v1/mp4/000000/0", "v1/mp4/000000/1"]

    def odd(b):
        return [{"a.json": 1} if w == 0 else {"b.json": 1} for w in b["window"]]

    with pytest.raises(InputError, match=r"output 'v0/mp4/000001' has fields \['b.json'\], the pass's are \['a.json'\]"):
        gdsload.process(media_src, tmp_path / "odd", odd, frames=(1.0, 2))

    def bad(b):
        raise RuntimeError("model exploded")

    with pytest.raises(FnError, match=r"from \('v0', 'mp4', window 0\) to \('v1', 'mp4', window 0\) raised "
                                      r"RuntimeError: model exploded"):
        gdsload.process(media_src, tmp_path / "bad", bad, frames=(1.0, 2), batch_size=3)
    with pytest.raises(FnError, match=r"returned 1 items; it must return a list of 3"):
        gdsload.process(media_src, tmp_path / "short", lambda b: [None], frames=(1.0, 2), batch_size=3,
                        overwrite=True)
    with pytest.raises(InputError, match=r"no extension"):
        gdsload.process(media_src, tmp_path / "bare", lambda b: [{"x": 1}] * len(b["window"]), frames=(1.0, 2),
                        overwrite=True)


def test_class_fn_is_instantiated_once_per_process(media_src: Path, tmp_path: Path) -> None:
    passfns.Counted.instances = 0
    gdsload.process(media_src, tmp_path / "c", passfns.Counted, frames=(1.0, 2), batch_size=2)
    assert passfns.Counted.instances == 1
    ds = gdsload.open_dataset(tmp_path / "c")
    assert {json.loads(ds[i]["n.json"]) for i in range(len(ds))} == {1}


def test_corrupt_media_follow_on_error(media_src: Path, tmp_path: Path) -> None:
    """A member FFmpeg cannot read: raise naming shard, key and field; skip: listed in
    rejected.jsonl and counted, the rest written. A member over max_hours is not decoded."""
    src = tmp_path / "src"
    shutil.copytree(media_src, src)
    ds = gdsload.open_dataset(src)
    s, j = ds.locate(ds.keys().index("v2"))
    off, n = next((o, n) for e, o, n in ds.index(s).members(j) if e == "mp4")
    with open(src / ds.shards[s]["name"], "r+b") as f:
        f.seek(off)
        f.write(b"\x00" * n)  # no container at all
    with pytest.raises(DecodeError, match=r"shard-\d+\.tar:v2 field 'mp4': unreadable media"):
        gdsload.process(src, tmp_path / "raise", Recorder(), frames=(1.0, 2))
    rec = Recorder()
    r = gdsload.process(src, tmp_path / "skip", rec, frames=(1.0, 2), on_error="skip")
    rejected = [json.loads(x) for x in (tmp_path / "skip" / "rejected.jsonl").read_text().splitlines()]
    assert [(x["key"], x["field"]) for x in rejected] == [("v2", "mp4")] and r["rejected"] == 1
    assert "v2" not in {k for b in rec.batches for k in b["__key__"]} and r["members"] == 5
    r = gdsload.process(media_src, tmp_path / "long", Recorder(), frames=(1.0, 2), on_error="skip",
                        max_hours=3.1 / 3600)
    rejected = [json.loads(x) for x in (tmp_path / "long" / "rejected.jsonl").read_text().splitlines()]
    assert {x["key"] for x in rejected} == {"v2", "v5"} and "over the limit of" in rejected[0]["reason"]


def test_members_are_read_by_range(media_src: Path, tmp_path: Path, monkeypatch) -> None:
    """The encoded member is read in range requests (READ_AHEAD bytes, or what PyAV asks for: its
    32 KiB buffer), never whole; each byte at most about once (a frames pass skips the audio
    stream's bytes: the demuxer jumps over them)."""
    monkeypatch.setattr(pmedia, "READ_AHEAD", 4096)
    sizes: list[int] = []
    real = gdsload.ShardedDataset.read_extent

    def spy(self, shard, offset, nbytes):
        sizes.append(nbytes)
        return real(self, shard, offset, nbytes)

    monkeypatch.setattr(gdsload.ShardedDataset, "read_extent", spy)
    gdsload.process(media_src, tmp_path / "o", Recorder(), frames=(1.0, 2), fields=["mp4"])
    ds = gdsload.open_dataset(media_src)
    mp4 = [n for s in range(len(ds.shards)) for j in range(ds.shards[s]["samples"])
           for e, _, n in ds.index(s).members(j) if e == "mp4"]
    assert max(sizes) <= 32768 < max(mp4) and 0.5 * sum(mp4) < sum(sizes) < 1.2 * sum(mp4)


def test_workers_give_the_same_bytes(media_src: Path, tmp_path: Path) -> None:
    """Output shards are cut per input shard: a pass in 2 worker processes writes the same files
    as one here (manifest apart from its creation time), several output shards per input shard."""
    kw = dict(frames=(5.0, 2), size=45, batch_size=3, shard_size="16KiB")
    a = gdsload.process(media_src, tmp_path / "local", passfns.frame_stats, **kw)
    b = gdsload.process(media_src, tmp_path / "w2", passfns.frame_stats, workers=2, **kw)
    assert_same_output(tmp_path / "w2", tmp_path / "local")
    assert a["shards"] > 3 and b["workers"] == 2 and a["windows"] == b["windows"]
    assert set(a["stages"]) == {"read", "decode", "fn", "write"} and a["stages"]["decode"] > 0
    assert abs(a["media_hours"] * 3600 - (3.0 + 1.9 + 4.0 + 2.0 + 2.0 + 3.4)) < 0.3


def test_bad_arguments_are_named(media_src: Path, tmp_path: Path) -> None:
    f = Recorder()
    for kw, msg in [({}, "exactly one of"), ({"frames": (1, 2), "speech": 1.0}, "exactly one of"),
                    ({"frames": (0, 2)}, r"frames fps"), ({"frames": (1, 2.5)}, r"frames window"),
                    ({"speech": 1.0, "fields": ["nope"]}, r"no field 'nope'"),
                    ({"speech": 1.0, "on_error": "ignore"}, r"on_error='ignore'"),
                    ({"speech": 1.0, "engine": "spark"}, r"engine='spark'")]:
        with pytest.raises(InputError, match=msg):
            gdsload.process(media_src, tmp_path / "x", f, **kw)
    with pytest.raises(InputError, match=r"feed=\.\.\., engine='ray'"):
        gdsload.process(media_src, tmp_path / "x", f, speech=1.0, feed="localhost:1", engine="ray")
    with pytest.raises(InputError, match=r"priority='high'"):
        gdsload.process(media_src, tmp_path / "x", f, speech=1.0, feed="localhost:1", priority="high")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(DestinationError, match=r"not gdsload's \(mine.txt\)"):
        gdsload.process(media_src, tmp_path / "full", f, speech=1.0)
