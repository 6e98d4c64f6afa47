"""Long recordings decode only the crop's window (issue 46 row 2).

The window's samples are the whole decode's, bit for bit (FLAC and WAV through DALI's resampler,
MP3 through FFmpeg's); Opus within 1e-5 (FFmpeg's decoder after a seek against libsndfile's, past
its 312-sample pre-skip; measured 1.5e-6, where a 16-bit step is 3.1e-5). The samples decoded and
the process's peak memory do not grow with the recording's length; a recording shorter than its
index says, or corrupt inside the window, is an error under `on_error`. Recordings are made here
with PyAV: a noisy chirp, so a window shifted by one sample does not match."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("nvidia.dali")

import gdsload
from gdsload.bench import mediagen as mg
from gdsload.convert.shards import DatasetWriter
from gdsload.decode import audio
from gdsload.decode.audio import AudioDecoder, AudioTransform, crop_start, whole_length
from gdsload.decode.media import probe
from gdsload.errors import DecodeError

LONG_S = 480  # 8 min: a 2 s crop is 1/240 of it
SR = 11025  # resampled to 16 kHz: a ratio DALI's resampler steps in float32 (windows must align)


def _signal(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """(channels, n) int16: a chirp plus noise, different per channel."""
    rng = np.random.default_rng(seed)
    n = round(seconds * rate)
    out = [np.sin(np.cumsum(rng.uniform(0.01, 0.3, n))) * 8000 + rng.integers(-2000, 2000, n) for _ in range(channels)]
    return np.asarray(out).astype(np.int16)


def _flac(x: np.ndarray, rate: int) -> bytes:
    import av

    layout = "mono" if x.shape[0] == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as c:
        s = c.add_stream("flac", rate=rate)
        s.layout, s.format = layout, "s16"
        for a in range(0, x.shape[1], 4608):
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, a : a + 4608].T.reshape(1, -1)), format="s16",
                                           layout=layout)
            f.sample_rate = rate
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def long_flac() -> bytes:
    return _flac(_signal(LONG_S, SR), SR)


@pytest.fixture(scope="module")
def long_set(tmp_path_factory, long_flac: bytes) -> Path:
    """Four samples: the 8 min mono FLAC and 90 s of stereo WAV at 22,050 Hz, except l2: 3 s of
    each (decoded whole, as before)."""
    root = tmp_path_factory.mktemp("long") / "ds"
    wav = mg.encode_wav(_signal(90, 22050, channels=2, seed=1), 22050)
    short = {"flac": _flac(_signal(3, SR, seed=2), SR), "wav": mg.encode_wav(_signal(3, 22050, 2, 3), 22050)}
    with DatasetWriter(root) as w:
        for i in range(4):
            w.write(f"l{i}", short if i == 2 else {"flac": long_flac, "wav": wav})
    return root


def _batch(root: Path, t: AudioTransform) -> dict:
    names = ["flac", "flac.length", "wav", "wav.length", "__key__"]
    (b,) = list(gdsload.DataLoader(str(root), batch_size=4, output="numpy", seed=5, fields=names,
                                   transform={"flac": t, "wav": t}))
    return dict(zip(names, b))


def _decode(dec: AudioDecoder, data: list[bytes], metas: list[dict], u: list[float], names=None):
    """`decode_into` of one batch: (output, lengths, kept rows)."""
    dst = np.zeros((len(data), *dec.t.output_shape()), np.float32)
    lengths = np.zeros(len(data), np.int64)
    draws = np.repeat(np.asarray(u, np.float64)[:, None], 6, axis=1)
    kept = dec.decode_into([np.frombuffer(d, np.uint8) for d in data], names or [f"s{i}" for i in range(len(data))],
                           metas, draws, dst, lengths)
    return dst, lengths, kept


@pytest.mark.parametrize("crop,mono", [("start", True), ("center", True), ("random", True), ("random", False)])
def test_window_is_the_whole_decode_cropped(long_set: Path, monkeypatch, crop: str, mono: bool) -> None:
    """Through the loader: the batch of windows equals, bit for bit, the batch the whole decode
    gives (FLAC resampled 11,025 -> 16,000 Hz; stereo WAV downmixed or kept, 22,050 -> 16,000)."""
    t = AudioTransform(sample_rate=16000, seconds=2.0, crop=crop, mono=mono)
    got = _batch(long_set, t)
    monkeypatch.setattr(audio, "WHOLE_FACTOR", 10**9)  # every recording decoded whole, then cropped
    want = _batch(long_set, t)
    for f in ("flac", "flac.length", "wav", "wav.length"):
        np.testing.assert_array_equal(got[f], want[f], err_msg=f)
    assert got["flac.length"].tolist() == got["wav.length"].tolist() == [32000] * 4
    assert got["wav"].shape == ((4, 32000) if mono else (4, 2, 32000))
    assert (np.abs(got["flac"].reshape(4, -1, 32000)[:, 0]).max(axis=-1) > 0.1).all()  # the signal, not zeros


def test_windows_across_the_recording_are_the_whole_decodes(long_flac: bytes) -> None:
    """Windows from the first sample to the last, each against the whole decode at its start:
    equal, and decoded from a seek (the samples decoded per window stay near the window's)."""
    data = np.frombuffer(long_flac, np.uint8)
    meta = probe(long_flac, "audio")
    d = AudioDecoder(AudioTransform(sample_rate=16000, seconds=2.0, crop="random"), batch_size=1)
    whole = d._dali_decode([(0, data)])[0]
    n = whole_length(meta, 16000)
    assert n == len(whole) == LONG_S * 16000
    for u in (0.0, 1e-6, 0.25, 0.5, 0.999, 1 - 1e-12):
        s = crop_start(d.t, n, u)
        before = d.samples_decoded
        w = d._dali_resample([(0, d._pyav_window(data, meta, s))])[0]
        np.testing.assert_array_equal(w, whole[s : s + 32000], err_msg=f"u={u}, start {s}")
        assert d.samples_decoded - before < 3 * SR  # 2 s, its margins and the seek's pre-roll
    assert s == n - 32000  # the last window ends at the recording's end


def test_samples_decoded_do_not_grow_with_the_recording(long_flac: bytes) -> None:
    """decode_into's own count: an 8 min and a 1 min recording cost the same per window; the 3 s
    one, decoded whole, counts all its samples (the counter counts)."""
    one_min = _flac(_signal(60, SR, seed=4), SR)
    short = _flac(_signal(3, SR, seed=5), SR)
    data = [long_flac, one_min, short]
    metas = [probe(x, "audio") for x in data]
    for crop in ("start", "center", "random"):
        d = AudioDecoder(AudioTransform(sample_rate=16000, seconds=2.0, crop=crop), batch_size=3)
        per = []
        for i in range(3):
            before = d.samples_decoded
            _, lengths, kept = _decode(d, [data[i]], [metas[i]], [0.7])
            assert kept == [0] and lengths.tolist() == [32000]
            per.append(d.samples_decoded - before)
        assert per[0] < 3 * SR and per[1] < 3 * SR, (crop, per)  # not 480 s or 60 s of samples
        assert per[2] == metas[2]["samples"] and d.windows == 2, (crop, per)


def test_peak_memory_does_not_grow_with_the_recording(tmp_path: Path) -> None:
    """A batch of 8 recordings of 10 min (8 kHz FLAC, 2 s crops at 16 kHz), in a fresh process:
    its peak RSS grows by what 8 recordings of 3 s cost plus their encoded bytes (~4 MB each,
    read by the loader). Decoding them whole took ~730 MB more (8 x 10 min at 16 kHz, float32,
    and DALI's source buffers); the bound is 150 MB."""
    long, short = mg.encode_audio("flac", seconds=600, sample_rate=8000), mg.encode_audio("flac", seconds=3,
                                                                                          sample_rate=8000)
    for name, data in (("long", long), ("short", short)):
        with DatasetWriter(tmp_path / name) as w:
            for i in range(8):
                w.write(f"r{i}", {"flac": data})
    script = textwrap.dedent("""
        import resource, sys
        import gdsload
        t = gdsload.AudioTransform(sample_rate=16000, seconds=2.0)
        def run(root):
            for (x,) in gdsload.DataLoader(root, batch_size=8, output="numpy", fields=["flac"], transform={"flac": t}):
                assert x.shape == (8, 32000)
        run(sys.argv[1])  # imports, DALI pipelines, thread pools: not what is measured
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run(sys.argv[2])
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "short"), str(tmp_path / "long")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    growth_mb = int(r.stdout.split()[-1])
    assert growth_mb < 150, f"peak RSS grew by {growth_mb} MB decoding 2 s crops of 10 min recordings"


@pytest.mark.parametrize("codec,rate,channels", [("mp3", 16000, 1), ("mp3", 44100, 2), ("opus", 48000, 1)])
def test_lossy_windows_are_the_whole_decodes(codec: str, rate: int, channels: int) -> None:
    """MP3 (FFmpeg decodes it, counted from the start, no seek) equals the whole decode at the
    same start; Opus (DALI's codec: PyAV seeks in Ogg, DALI resamples) within 1e-5 past its
    pre-skip (measured 1.5e-6: FFmpeg's decoder after a 0.25 s pre-roll against libsndfile's from
    the start). Their index counts the encoder's delay and padding, so a window never runs past the
    real end (the length is the full 2 s even at the last possible start)."""
    x = mg.encode_audio(codec, seconds=40.0, sample_rate=rate, channels=channels, freq=300)
    data, meta = np.frombuffer(x, np.uint8), probe(x, "audio")
    d = AudioDecoder(AudioTransform(sample_rate=16000, seconds=2.0), batch_size=1)
    whole = d._dali_decode([(0, data)])[0] if codec == "opus" else d._pyav_decode(data)
    n = whole_length(meta, 16000)
    assert n <= len(whole)
    for u in (0.0, 0.3, 0.999999):
        s = crop_start(d.t, n, u)
        w = d._pyav_window(data, meta, s)
        if isinstance(w, audio._Pending):
            w = d._dali_resample([(0, w)])[0]
        assert len(w) == 32000, (u, len(w))
        ref = whole[s : s + 32000]
        if codec == "mp3":
            np.testing.assert_array_equal(w, ref, err_msg=f"u={u}")
        else:
            skip = max(0, 104 - s)  # 312 samples at 48 kHz: DALI returns them, FFmpeg drops them (zeros here)
            np.testing.assert_allclose(w[skip:], ref[skip:], atol=1e-5, rtol=0, err_msg=f"u={u}")
    _, lengths, kept = _decode(d, [x], [meta], [0.999999])
    assert kept == [0] and lengths.tolist() == [32000]


def test_truncated_or_corrupt_long_recordings_are_errors(long_flac: bytes) -> None:
    """A recording that ends before its window (its index says 8 min, it holds 30 s) and one with
    a corrupt frame inside the window: errors naming the sample and the reason (FFmpeg skips a
    frame that fails its CRC; the window path must not return the gap as silence), skipped and
    counted with on_error='skip'."""
    meta = probe(long_flac, "audio")
    truncated = _flac(_signal(30, SR, seed=6), SR)
    bad = bytearray(long_flac)
    mid = len(bad) // 2  # the centre crop's bytes (a noisy chirp: about constant bits per second)
    bad[mid : mid + 2000] = bytes(2000)
    t = AudioTransform(sample_rate=16000, seconds=2.0, crop="center")
    d = AudioDecoder(t, batch_size=3)
    with pytest.raises(DecodeError, match=r"cannot decode audio shard:a0 .*ends at 30\.00 s, before its crop at "
                                          r"239\.00 s \(the index says 480\.00 s\): truncated or corrupt"):
        _decode(d, [truncated], [meta], [0.5], names=["shard:a0"])
    with pytest.raises(DecodeError, match=r"shard:a1 .*corrupt audio: \d+ samples missing at 2\d\d\.\d\d s"):
        _decode(d, [bytes(bad)], [meta], [0.5], names=["shard:a1"])
    d = AudioDecoder(t, batch_size=3, on_error="skip")
    out, lengths, kept = _decode(d, [truncated, bytes(bad), long_flac], [meta, meta, meta], [0.5] * 3)
    assert kept == [2] and d.skipped == 2 and lengths[2] == 32000
