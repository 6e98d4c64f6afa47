"""Video and audio: conversion probes and rejects, clip sampling, resume, audio lengths, limits.

All media are made here with PyAV (`gdsload.bench.mediagen`): frame i of a video is grey at
brightness `level(i)`, so the mean of a returned frame says which source frame it is. H.264 goes
through PyAV, VP9 and MJPEG through DALI's CPU video decoder; FLAC, Opus and WAV through DALI's
audio decoder, MP3 through PyAV. Tiny clips (64 x 48, <= 30 frames), a few samples each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("nvidia.dali")

import gdsload
from gdsload.bench import mediagen as mg
from gdsload.convert.shards import DatasetWriter
from gdsload.decode.audio import AudioDecoder, AudioTransform
from gdsload.decode.media import clip_indices, draws
from gdsload.decode.video import VideoTransform
from gdsload.errors import ConfigError, DecodeError
from gdsload.format.index import ShardIndex

LENGTHS = [20, 8, 30, 14, 20, 25]  # frames per video; 8 is shorter than a 4-frame clip at stride 3
RAW = {"size": None, "dtype": "uint8", "layout": "NTHWC"}  # frames untouched: brightness readable


def _dataset(root: Path, codec: str, lengths=LENGTHS) -> Path:
    ext = mg.EXT[codec]
    with DatasetWriter(root) as w:
        for i, n in enumerate(lengths):
            w.write(f"v{i}", {ext: mg.encode_video(codec, frames=n, gop=6), "cls": b"%d" % i})
    return root


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("media")
    return {c: _dataset(base / c, c) for c in ("h264", "vp9", "mjpeg")}


def _frame_ids(clip: np.ndarray) -> list[int]:
    """(T, H, W, C) uint8 frames -> the source frame index of each (-1 for an all-zero frame)."""
    return [-1 if f.max() == 0 else mg.frame_of(float(f.mean())) for f in clip]


def _mod(idx) -> list[int]:
    """Frame indices as brightness tells them: levels repeat every 20 frames."""
    return [-1 if i < 0 else i % 20 for i in np.asarray(idx).tolist()]


def _batches(root: Path, ext: str, t: VideoTransform, **kw) -> list[dict]:
    return list(gdsload.DataLoader(str(root), batch_size=3, output="numpy", transform={ext: t}, **kw))


# -- conversion ----------------------------------------------------------------------------------
def test_convert_probes_stores_unchanged_and_rejects_with_reasons(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    good = mg.encode_video("h264", frames=12)
    (src / "a.mp4").write_bytes(good)
    (src / "b.mp4").write_bytes(b"\x00not a video" * 40)
    (src / "c.mp4").write_bytes(mg.encode_video("h264_444", frames=4))
    (src / "d.mp4").write_bytes(good[: len(good) // 3])  # demuxes partly: --validate decodes it
    for k in "abcd":
        (src / f"{k}.flac").write_bytes(mg.encode_audio("flac", seconds=0.5, sample_rate=8000))
    dst = tmp_path / "dst"
    r = subprocess.run([sys.executable, "-m", "gdsload", "convert", str(src), str(dst), "--validate"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rejects = {j["key"]: j["reason"] for j in map(json.loads, (dst / "rejected.jsonl").read_text().splitlines())}
    assert "unreadable media" in rejects["b"]
    assert "yuv444p" in rejects["c"] and "NVDEC" in rejects["c"]
    assert "d" in rejects
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["fields"] == {"flac": "audio", "mp4": "video"}
    idx = ShardIndex.load(dst / manifest["shards"][0]["index"])
    assert idx.keys() == ["a"]
    v = idx.media_info("mp4", 0)
    assert (v["codec"], v["width"], v["height"], v["frames"], v["fps"]) == ("h264", 64, 48, 12, 10.0)
    assert v["keyint"] >= 1 and v["bits"] == 8
    a = idx.media_info("flac", 0)
    assert (a["codec"], a["sample_rate"], a["channels"], a["samples"]) == ("flac", 8000, 1, 4000)
    tar = (dst / manifest["shards"][0]["name"]).read_bytes()
    assert good in tar  # stored unchanged
    r = subprocess.run([sys.executable, "-m", "gdsload", "verify", str(dst)], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_a_transform_media_stay_bytes(videos) -> None:
    b = next(iter(gdsload.DataLoader(str(videos["h264"]), batch_size=2, output="numpy")))
    assert isinstance(b["mp4"][0], bytes) and b["mp4"][0][4:8] == b"ftyp"


# -- clips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["h264", "vp9", "mjpeg"])
def test_start_stride_and_padding(videos, codec: str) -> None:
    ext = mg.EXT[codec]
    t = VideoTransform(frames=4, stride=3, sampling="uniform", **RAW)
    seen = {}
    for b in _batches(videos[codec], ext, t):
        assert b[ext].shape[1:] == (4, 48, 64, 3) and b[ext].dtype == np.uint8
        for key, clip, idx in zip(b["__key__"], b[ext], b[ext + ".frames"]):
            assert _frame_ids(clip) == _mod(idx)
            seen[key] = idx.tolist()
    assert seen["v0"] == [0, 3, 6, 9]
    assert seen["v1"] == [0, 3, 6, -1]  # 8 frames: the fourth is padding, zeros


_FORK_AFTER_SCALE = """
import io, multiprocessing as mp
import av, numpy as np
from gdsload.bench import mediagen as mg
from gdsload.decode.video import VideoDecoder

def frames(data):
    return VideoDecoder._pyav_decode(np.frombuffer(data, np.uint8), np.arange(0, 12, 3))[0]

data = mg.encode_video("h264", frames=12, gop=6)
with av.open(io.BytesIO(data)) as c:
    for f in c.decode(video=0):
        f.to_ndarray(format="rgb24", width=32, height=24)  # PyAV's shared scaler, its default threads
here = frames(data)
with mp.get_context("fork").Pool(1) as pool:
    there = pool.apply_async(frames, (data,)).get(timeout=60)
np.testing.assert_array_equal(there, here)
print([mg.frame_of(float(f.mean())) for f in here])
"""


def test_a_process_forked_after_a_video_scale_decodes_too() -> None:
    """PyAV 18 keeps a frame scaler per thread, with slice threads by default (PyAV >= 17); a
    process forked from a thread that used it hangs the next time it scales on that thread (this
    project's CI: a DataLoader's worker and a pool's, forked by a pytest worker that had decoded
    video earlier). In a process of its own (the scaler it leaves would follow this worker's later
    forks): the main thread scales as a user's code would, then a forked child runs gdsload's PyAV
    decode on its main thread. It must finish, with the parent's frames
    (`gdsload.decode.media.rgb24_scaler`); before, the child hung and the pool timed out."""
    p = subprocess.run([sys.executable, "-c", _FORK_AFTER_SCALE], capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n")[-2] == "[0, 3, 6, 9]"


def test_center_random_and_several_clips(videos) -> None:
    t = VideoTransform(frames=3, stride=2, sampling="center", **RAW)
    b = {k: f.tolist() for bb in _batches(videos["vp9"], "webm", t) for k, f in zip(bb["__key__"], bb["webm.frames"])}
    assert b["v2"] == [12, 14, 16]  # 30 frames, span 5: start (30 - 5) // 2
    t = VideoTransform(frames=2, stride=1, clips=3, sampling="uniform", **RAW)
    for bb in _batches(videos["h264"], "mp4", t):
        assert bb["mp4"].shape[1:] == (3, 2, 48, 64, 3)
        for key, clips, idx in zip(bb["__key__"], bb["mp4"], bb["mp4.frames"]):
            n = LENGTHS[int(key[1:])]
            assert idx[:, 0].tolist() == np.floor(np.arange(3) * (n - 2) / 2).astype(int).tolist()
            for c in range(3):
                assert _frame_ids(clips[c]) == _mod(idx[c])
    t = VideoTransform(frames=2, stride=2, sampling="random", **RAW)
    starts = set()
    for seed in range(6):
        for bb in _batches(videos["h264"], "mp4", t, seed=seed):
            for clip, idx in zip(bb["mp4"], bb["mp4.frames"]):
                assert _frame_ids(clip) == _mod(idx)
                starts.add(int(idx[0]))
    assert len(starts) > 3  # positions vary with the seed


def test_resume_samples_the_same_clips(videos) -> None:
    t = VideoTransform(frames=2, stride=2, sampling="random", size=16, train=True, dtype="float32")
    kw = {"batch_size": 2, "shuffle": True, "seed": 7, "output": "numpy", "transform": {"mp4": t}}
    full = list(gdsload.DataLoader(str(videos["h264"]), **kw))
    dl = gdsload.DataLoader(str(videos["h264"]), **kw)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    del it
    dl2 = gdsload.DataLoader(str(videos["h264"]), **kw)
    dl2.load_state_dict(state)
    rest = list(dl2)
    assert len(rest) == len(full) - 1
    for a, b in zip(full[1:], rest):
        assert a["__key__"] == b["__key__"]
        np.testing.assert_array_equal(a["mp4.frames"], b["mp4.frames"])
        np.testing.assert_array_equal(a["mp4"], b["mp4"])  # the same crop and flip too
        assert a["mp4"].shape == (2, 3, 2, 16, 16) and np.isfinite(a["mp4"]).all()


def test_clip_math() -> None:
    assert clip_indices(10, 4, 3, 1, "uniform", 0.9).tolist() == [[0, 3, 6, 9]]
    assert clip_indices(10, 4, 3, 1, "random", 0.99).tolist() == [[0, 3, 6, 9]]  # no room: start 0
    assert clip_indices(5, 3, 3, 1, "random", 0.5).tolist() == [[0, 3, -1]]
    assert clip_indices(100, 2, 1, 1, "random", 0.999).tolist() == [[98, 99]]
    a = draws(1, 2, np.arange(5), 3, k=2)
    assert a.shape == (5, 2) and ((a >= 0) & (a < 1)).all()
    np.testing.assert_array_equal(a, draws(1, 2, np.arange(5), 3, k=2))
    assert not np.array_equal(a, draws(1, 3, np.arange(5), 3, k=2))


# -- limits and corrupt media --------------------------------------------------------------------
def test_limits_refused_before_decoding_and_named(videos) -> None:
    t = VideoTransform(frames=2, max_frames=15, **RAW)
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:v0.*20 frames, over the limit of 15"):
        _batches(videos["h264"], "mp4", t)
    kept = [k for b in _batches(videos["h264"], "mp4", t, on_error="skip") for k in b["__key__"]]
    assert kept == ["v1", "v3"]
    with pytest.raises(DecodeError, match=r"64 x 48 pixels, over the limit of 1000"):
        _batches(videos["vp9"], "webm", VideoTransform(frames=2, max_pixels=1000, **RAW))


def _corrupt(root: Path, key: str, ext: str) -> None:
    """Overwrite a member's payload in its shard (the index still points at it)."""
    m = json.loads((root / "manifest.json").read_text())
    idx = ShardIndex.load(root / m["shards"][0]["index"])
    j = idx.keys().index(key)
    off, n = next((o, n) for e, o, n in idx.members(j) if e == ext)
    with open(root / m["shards"][0]["name"], "r+b") as f:
        f.seek(off + 32)
        f.write(b"\xff" * (n - 32))


@pytest.mark.parametrize("codec", ["h264", "vp9"])
def test_corrupt_video_named_and_skipped(tmp_path: Path, codec: str) -> None:
    ext = mg.EXT[codec]
    root = _dataset(tmp_path / codec, codec, lengths=[10, 10, 10])
    _corrupt(root, "v1", ext)
    t = VideoTransform(frames=2, **RAW)
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:v1"):
        list(gdsload.DataLoader(gdsload.Dataset(str(root), verify=None), batch_size=3, output="numpy",
                                transform={ext: t}))
    b = list(gdsload.DataLoader(gdsload.Dataset(str(root), verify=None), batch_size=3, output="numpy",
                                transform={ext: t}, on_error="skip"))
    assert b[0]["__key__"] == ["v0", "v2"] and b[0][ext].shape[0] == 2
    assert b[0]["cls"].tolist() == [0, 2]


# -- audio ---------------------------------------------------------------------------------------
SECONDS = [1.0, 0.5, 2.0]  # per sample; each sample has all four formats
RATES = {"flac": 8000, "opus": 48000, "mp3": 16000, "wav": 22050}  # source rates: all resampled to 16 kHz


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audio") / "ds"
    with DatasetWriter(root) as w:
        for i, sec in enumerate(SECONDS):
            w.write(f"a{i}", {c: mg.encode_audio(c, seconds=sec, sample_rate=r) for c, r in RATES.items()}
                    | {"ramp.wav": mg.ramp_wav(int(sec * 16000))})
    return root


def test_audio_length_after_resample_crop_and_pad(audio: Path) -> None:
    t = AudioTransform(sample_rate=16000, seconds=1.0, crop="start")
    b = next(iter(gdsload.DataLoader(str(audio), batch_size=3, output="numpy", transform={c: t for c in RATES})))
    for c in RATES:
        x, n = b[c], b[c + ".length"]
        assert x.shape == (3, 16000) and x.dtype == np.float32, c
        tol = 1200 if c in ("opus", "mp3") else 2  # encoder delay and padding of lossy codecs
        assert abs(int(n[0]) - 16000) <= 2 and abs(int(n[1]) - 8000) <= tol and int(n[2]) == 16000, (c, n)
        assert np.all(x[1, int(n[1]):] == 0)  # padded with zeros
        assert 0.1 < np.abs(x[0, : int(n[0])]).max() <= 1.0  # the tone, in [-1, 1]


def test_audio_crop_positions_from_the_plan(audio: Path) -> None:
    def first(crop: str, seed: int = 0) -> dict[str, int]:
        t = AudioTransform(seconds=0.25, crop=crop)
        out = {}
        for b in gdsload.DataLoader(str(audio), batch_size=3, output="numpy", seed=seed, fields=["ramp.wav", "__key__"],
                                    transform={"ramp.wav": t}):
            for k, x in zip(b[1], b[0]):
                out[k] = round(float(x[0]) * 32768)  # sample i holds i (int16 -> [-1, 1))
        return out

    assert first("start") == {"a0": 0, "a1": 0, "a2": 0}
    assert first("center") == {"a0": 6000, "a1": 2000, "a2": 14000}  # (n - 4000) // 2
    runs = [first("random", s) for s in range(4)]
    assert runs[0] == first("random", 0)  # the same seed, the same crops
    assert len({r["a2"] for r in runs}) > 1
    for r in runs:
        assert 0 <= r["a2"] <= 32000 - 4000


def test_logmel_features(audio: Path) -> None:
    t = AudioTransform(seconds=1.0, crop="start", features="logmel", n_mels=40, n_fft=400, hop=160)
    b = next(iter(gdsload.DataLoader(str(audio), batch_size=3, output="numpy", transform={"flac": t})))
    assert b["flac"].shape == (3, 40, 101) and b["flac.length"].tolist() == [101, 51, 101]
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = (0.5 * np.sin(np.arange(4000) / 16000 * 2 * np.pi * 440) + 0.1 * rng.standard_normal(4000)).astype(np.float32)
    spec = torch.stft(torch.from_numpy(x), 400, 160, window=torch.hann_window(400), center=True,
                      pad_mode="reflect", return_complex=True).abs().pow(2).numpy()
    from gdsload.decode.audio import mel_filters

    ref = 10 * np.log10(np.maximum(mel_filters(16000, 400, 40) @ spec, 1e-10))
    got = AudioDecoder(AudioTransform(features="logmel", n_mels=40), batch_size=2).features([x, x[:1600]])
    assert got[0].shape == (40, 26) and got[1].shape == (40, 11)
    np.testing.assert_allclose(got[0], ref, atol=0.5)  # dB
    # more filters than bins can separate: some triangles hold no bin and must give -100 dB, not a neighbour
    fb = mel_filters(16000, 64, 80)
    assert (fb.sum(1) == 0).sum() > 0
    spec = torch.stft(torch.from_numpy(x), 64, 16, window=torch.hann_window(64), center=True,
                      pad_mode="reflect", return_complex=True).abs().pow(2).numpy()
    got = AudioDecoder(AudioTransform(features="logmel", n_mels=80, n_fft=64, hop=16), batch_size=1).features([x])
    np.testing.assert_allclose(got[0], 10 * np.log10(np.maximum(fb @ spec, 1e-10)), atol=0.5)


def test_audio_limit_and_config_errors(audio: Path) -> None:
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:a0.*over the limit of 0.75 s"):
        list(gdsload.DataLoader(str(audio), batch_size=3, output="numpy",
                                transform={"flac": AudioTransform(max_seconds=0.75)}))
    with pytest.raises(ConfigError, match="share one ImageTransform"):
        gdsload.DataLoader(str(audio), transform={"a.jpg": gdsload.ImageTransform(size=8),
                                                  "b.jpg": gdsload.ImageTransform(size=9)})
    with pytest.raises(ValueError, match="needs dtype='uint8'"):
        VideoTransform(size=None)


def test_eval_crop_resize_normalise_keeps_each_frame(videos) -> None:
    t = VideoTransform(frames=3, stride=4, sampling="uniform", size=16, train=False, resize=20, mean=None, std=None,
                       dtype="float32")
    for b in _batches(videos["mjpeg"], "avi", t):
        assert b["avi"].shape[1:] == (3, 3, 16, 16) and b["avi"].dtype == np.float32  # N, C, T, H, W
        for clip, idx in zip(b["avi"], b["avi.frames"]):
            got = [-1 if clip[:, k].max() == 0 else mg.frame_of(float(clip[:, k].mean())) for k in range(3)]
            assert got == _mod(idx)


def test_inspect_knows_the_kinds(videos) -> None:
    r = subprocess.run([sys.executable, "-m", "gdsload", "inspect", str(videos["vp9"]), "--json"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    md = json.loads(r.stdout)["media"]["webm"]
    assert md["kind"] == "video" and md["codecs"] == {"vp9": len(LENGTHS)}
    assert md["frames"] == [8, 30] and md["width"] == [64, 64] and md["pix_fmt"] == {"yuv420p": len(LENGTHS)}


def test_example_train_video_tiny_runs() -> None:
    pytest.importorskip("torch")
    script = Path(__file__).resolve().parents[1] / "examples" / "train_video_tiny.py"
    r = subprocess.run([sys.executable, str(script), "--tiny", "--steps", "4"], check=False, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "steps 4" in r.stdout and "video (8, 3, 8, 32, 32), audio (8, 32, 51)" in r.stdout


def test_the_feed_serves_video_and_audio(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("grpc_health")
    pytest.importorskip("prometheus_client")
    from gdsload.service.server import create_server

    root = tmp_path / "root"
    with DatasetWriter(root / "av") as w:
        for i, n in enumerate([12, 6, 16, 9]):
            w.write(f"s{i}", {"webm": mg.encode_video("vp9", frames=n), "flac": mg.encode_audio(
                "flac", seconds=0.3 + 0.1 * i, sample_rate=8000), "cls": b"%d" % i})
    tf = {"webm": VideoTransform(frames=3, stride=2, size=16, train=True), "flac": AudioTransform(seconds=0.4)}
    local = list(gdsload.DataLoader(str(root / "av"), batch_size=2, shuffle=True, seed=3, output="numpy", transform=tf))
    srv, port = create_server([str(root)], max_message_bytes=64 * 1024)
    srv.start()
    try:
        remote = list(gdsload.RemoteLoader(f"127.0.0.1:{port}", dataset="av", batch_size=2, shuffle=True, seed=3,
                                           output="numpy", transform=tf))
    finally:
        srv.shutdown(grace_s=2)
    assert len(remote) == len(local) == 2
    for r, loc in zip(remote, local):
        assert r["__key__"] == loc["__key__"]
        for f in ("webm", "webm.frames", "flac", "flac.length", "cls"):
            np.testing.assert_array_equal(r[f], loc[f])
    assert remote[0]["webm"].shape == (2, 3, 3, 16, 16)


def test_media_bench_contestants_agree_on_tiny_sets(tmp_path: Path) -> None:
    """The benchmark's runs (bench/media_bench.py, `gdsload bench` on a media dataset) as a tiny
    test, in-process: every contestant delivers every clip; gdsload and torch + PyAV decode the
    same frames of the H.264 set (the same clip positions, from the plan's draws)."""
    pytest.importorskip("torch")
    from gdsload.bench import media

    sets = media.make_sets(tmp_path, videos=4, audios=2, width=96, height=64, video_frames=40,
                           audio_seconds=10.5, log=lambda m: None)
    args = {"batch_size": 2, "threads": 1, "seed": 0}
    names = ["gdsload", "torch_pyav"] + (["spdl"] if media.missing("spdl") is None else [])
    runs = {c: media.run_contestant({**args, "dataset": str(sets["h264"]), "contestant": c}) for c in names}
    assert {r["clips"] for r in runs.values()} == {2}
    g, t = runs["gdsload"], runs["torch_pyav"]
    assert g["frames_returned"] == t["frames_returned"] == 2 * media.FRAMES
    assert g["frames_decoded"] == t["frames_decoded"]
    r = media.run_contestant({**args, "dataset": str(sets["flac"]), "contestant": "gdsload"})
    assert r["clips"] == 2 and r["kind"] == "audio"
    # the same clip (frames, crop) and the same log-mel crop as the baselines, up to resize rounding
    for name, field, t in (("h264", "mp4", VideoTransform(frames=media.FRAMES, stride=media.STRIDE, size=media.SIZE,
                                                          train=False, resize=media.RESIZE)),
                           ("flac", "flac", AudioTransform(seconds=media.SECONDS, features="logmel"))):
        ref = media._TorchSet(str(sets[name]), 0)[0][0].numpy()
        (ours,) = next(iter(gdsload.DataLoader(str(sets[name]), batch_size=1, output="numpy", transform={field: t},
                                               fields=[field])))
        assert ours[0].shape == ref.shape
        assert np.abs(ours[0] - ref).mean() < (0.1 if name == "h264" else 0.2), name


def test_stats_report_decode_amplification(videos) -> None:
    dl = gdsload.DataLoader(str(videos["h264"]), batch_size=3, output="numpy",
                            transform={"mp4": VideoTransform(frames=2, stride=2, sampling="center", **RAW)})
    got = list(dl)
    m = dl.stats()["media"]["mp4"]
    assert m["frames_returned"] == 2 * len(LENGTHS) and sum(len(b["__key__"]) for b in got) == len(LENGTHS)
    # centred 3-frame spans; from frame 0 to each span's last frame would be `from_start`: PyAV
    # seeks to the keyframe before each clip (GOP 6), so it decodes fewer
    from_start = sum((n - 3) // 2 + 3 for n in LENGTHS)
    assert m["frames_returned"] <= m["frames_decoded"] < from_start
    dl.close()
    assert dl.stats()["media"]["mp4"]["decode_amplification"] == m["frames_decoded"] / m["frames_returned"]


def test_device_ring_gets_the_same_clips_and_audio(monkeypatch, tmp_path: Path) -> None:
    """On a GPU host (the CUDA fakes of tests/gpu_fakes.py) media are decoded on the host into the
    slot's pinned "__h_" fields and copied to the device ring: the batches equal a CPU loader's.
    NVDEC itself (`device="mixed"`) is not faked: H.264 goes to PyAV here as on a CPU host."""
    import gpu_fakes

    from gdsload.decode import video

    root = tmp_path / "av"
    with DatasetWriter(root) as w:
        for i, n in enumerate([12, 6, 16]):
            w.write(f"s{i}", {"mp4": mg.encode_video("h264", frames=n), "flac": mg.encode_audio(
                "flac", seconds=0.3 + 0.1 * i, sample_rate=8000), "cls": b"%d" % i})
    tf = {"mp4": VideoTransform(frames=3, stride=2, sampling="center", **RAW), "flac": AudioTransform(seconds=0.4)}
    cpu = list(gdsload.DataLoader(str(root), batch_size=3, output="numpy", transform=tf, device="cpu"))
    gpu_fakes.install(monkeypatch, devices=1)
    monkeypatch.setattr(video, "NVDEC_VIDEO", frozenset())
    dev = list(gdsload.DataLoader(str(root), batch_size=3, output="numpy", transform=tf, device="cuda"))
    for a, b in zip(cpu, dev):
        for f in ("mp4", "mp4.frames", "flac", "flac.length", "cls"):
            assert hasattr(b[f], "__cuda_array_interface__"), f
            np.testing.assert_array_equal(a[f], b[f].get())


def test_class_folders_of_videos(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for k in range(2):
            (src / c / f"{c}{k}.mp4").write_bytes(mg.encode_video("h264", frames=6))
    r = subprocess.run([sys.executable, "-m", "gdsload", "convert", str(src), str(tmp_path / "ds")],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert m["fields"] == {"cls": "label", "mp4": "video"} and m["classes"] == ["cat", "dog"]
    (src / "cat" / "photo.jpg").write_bytes(b"\xff\xd8" + b"\0" * 100)
    r = subprocess.run([sys.executable, "-m", "gdsload", "convert", str(src), str(tmp_path / "ds2")],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "mix image and video files" in r.stderr


def test_index_media_columns_are_additive() -> None:
    """An index with media columns holds the version-1 arrays unchanged plus `media_<i>` arrays
    and a `media` entry in its meta, which older readers (they load arrays by name) never touch;
    a damaged media entry is a FormatError naming the file."""
    import io as _io

    from gdsload.errors import FormatError

    samples = [("a", [("mp4", 4096, 100), ("cls", 8192, 1)]), ("b", [("mp4", 12288, 50), ("cls", 16384, 1)])]
    media = [{"mp4": {"kind": "video", "codec": "h264", "frames": 20, "fps": 10.0, "pix_fmt": "yuv420p"}},
             {"mp4": {"kind": "video", "codec": "vp9", "frames": 8, "fps": 25.0, "pix_fmt": "yuv420p"}}]
    plain = ShardIndex.build(samples, crc=[1, 2, 3, 4])
    rich = ShardIndex.build(samples, crc=[1, 2, 3, 4], media=media)
    with np.load(_io.BytesIO(plain.to_bytes())) as a, np.load(_io.BytesIO(rich.to_bytes())) as b:
        assert set(b.files) == set(a.files) | {"media_0"}
        for k in a.files:
            if k != "meta":
                np.testing.assert_array_equal(a[k], b[k])
        meta_a, meta_b = json.loads(bytes(a["meta"])), json.loads(bytes(b["meta"]))
        assert {k: v for k, v in meta_b.items() if k != "media"} == meta_a
    back = ShardIndex.from_bytes(rich.to_bytes())
    assert back.media_info("mp4", 1) == {"kind": "video", "codec": "vp9", "frames": 8, "fps": 25.0, "pix_fmt": "yuv420p"}
    assert back.media_info("cls", 0) is None and plain.media_info("mp4", 0) is None
    broken = _io.BytesIO()
    with np.load(_io.BytesIO(rich.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["media_0"] = arrays["media_0"][:1]
    np.savez(broken, **arrays)
    with pytest.raises(FormatError, match="idx-x: media columns"):
        ShardIndex.from_bytes(broken.getvalue(), name="idx-x")


def test_media_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    """bench/media_gpu_check.py, the GPU check's video and audio step, run with device="cpu":
    DALI's CPU VP9 frames match PyAV's by PSNR; DALI audio matches PyAV's resampled waveform."""
    script = Path(__file__).resolve().parents[1] / "bench" / "media_gpu_check.py"
    r = subprocess.run([sys.executable, str(script), "make", str(tmp_path)], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(script), "check", str(tmp_path), "--device", "cpu"], check=False,
                       capture_output=True, text=True, timeout=120)
    rows = {j["step"]: j for j in map(json.loads, (ln for ln in r.stdout.splitlines() if ln.startswith("{")))}
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert rows["video_vp9"]["status"] == "PASS" and rows["video_h264"]["status"] == "SKIP"
    assert rows["audio_flac"]["status"] == rows["audio_wav"]["status"] == "PASS"


def test_corrupt_audio_named_and_skipped(tmp_path: Path) -> None:
    root = tmp_path / "a"
    with DatasetWriter(root) as w:
        for i in range(3):
            w.write(f"v{i}", {"flac": mg.encode_audio("flac", seconds=0.5, sample_rate=8000), "cls": b"%d" % i})
    _corrupt(root, "v2", "flac")
    t = {"flac": AudioTransform(seconds=0.5)}
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:v2"):
        list(gdsload.DataLoader(gdsload.Dataset(str(root), verify=None), batch_size=3, output="numpy", transform=t))
    b = list(gdsload.DataLoader(gdsload.Dataset(str(root), verify=None), batch_size=3, output="numpy", transform=t,
                                on_error="skip"))
    assert b[0]["__key__"] == ["v0", "v1"] and b[0]["flac.length"].tolist() == [8000, 8000]


def test_audio_keeps_channels_without_mono(tmp_path: Path) -> None:
    root = tmp_path / "st"
    with DatasetWriter(root) as w:
        for i, ch in enumerate([2, 1]):
            w.write(f"s{i}", {c: mg.encode_audio(c, seconds=0.5, sample_rate=r, channels=ch)
                              for c, r in (("flac", 8000), ("mp3", 16000))})
    t = AudioTransform(seconds=0.4, mono=False, crop="start")
    b = next(iter(gdsload.DataLoader(str(root), batch_size=2, output="numpy", transform={"flac": t, "mp3": t})))
    for f in ("flac", "mp3"):  # DALI (FLAC) and PyAV (MP3) alike
        x = b[f]
        assert x.shape == (2, 2, 6400) and b[f + ".length"].tolist() == [6400, 6400]
        peak = np.abs(x).max(axis=2)
        assert (peak[0] > 0.2).all() and peak[1, 0] > 0.2 and peak[1, 1] == 0  # a mono source: channel 1 zeros


def test_tuple_fields_take_the_frame_indices(videos) -> None:
    t = VideoTransform(frames=2, stride=1, sampling="uniform", **RAW)
    b = next(iter(gdsload.DataLoader(str(videos["vp9"]), batch_size=2, output="numpy", transform={"webm": t},
                                     fields=["webm", "webm.frames", "cls"])))
    clips, idx, cls = b
    assert clips.shape == (2, 2, 48, 64, 3) and idx.tolist() == [[0, 1], [0, 1]] and cls.tolist() == [0, 1]
