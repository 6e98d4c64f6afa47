"""The media benchmark's audio contestants do gdsload's work (bench/media_bench.py --sets flac).

Every contestant decodes the whole recording, crops 10 s from the same draw (`draws(seed, 0, id)`,
the crop's start from the decoded length) and computes the same log-mel (n_fft 400, hop 160, 80
HTK mels; the baselines with `torch.stft` in float32). Their features must be gdsload's for the
same sample, up to float32 FFT rounding in the quietest bins. SPDL runs where it is installed
(a bench-only virtual environment: bench/README.md).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import gdsload
from gdsload.bench import media


def _flac(x: np.ndarray) -> bytes:
    """Mono int16 samples as FLAC at the bench's rate."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as c:
        s = c.add_stream("flac", rate=media.SR)
        s.layout, s.format = "mono", "s16"
        for a in range(0, len(x), 4608):
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, a : a + 4608]), format="s16", layout="mono")
            f.sample_rate = media.SR
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _recording(seed: int) -> np.ndarray:
    """12 s of a chirp and noise whose loudness changes every 0.1 s: a crop moved by one hop
    (160 samples) changes the features."""
    rng = np.random.default_rng(seed)
    n = 12 * media.SR
    envelope = np.repeat(rng.uniform(0.05, 1.0, n // 1600 + 1), 1600)[:n]
    x = np.sin(np.cumsum(rng.uniform(0.01, 0.3, n))) * 0.6 + rng.uniform(-0.1, 0.1, n)
    return (envelope * x * 20000).astype(np.int16)


def test_audio_contestants_compute_gdsloads_features(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("av")
    from gdsload.convert.shards import DatasetWriter

    ds = tmp_path / "flac"
    with DatasetWriter(ds) as w:
        for i in range(4):
            w.write(f"a{i:05d}", {"flac": _flac(_recording(i)), "cls": b"0"})
    ds = str(ds)
    t = gdsload.AudioTransform(sample_rate=media.SR, seconds=media.SECONDS, crop="random", features="logmel",
                               n_mels=media.N_MELS, n_fft=media.N_FFT, hop=media.HOP)
    (ours,) = next(iter(gdsload.DataLoader(ds, batch_size=4, shuffle=False, seed=0, output="numpy", fields=["flac"],
                                           transform={"flac": t})))
    ts = media._TorchSet(ds, 0)
    baselines = {"torch_pyav": lambda i: ts[i][0]}
    if media.missing("spdl") is None:
        baselines["spdl"] = lambda i: media._spdl_one(ts, i)
    for name, one in baselines.items():
        for i in range(4):
            theirs = one(i).numpy()
            assert theirs.shape == ours[i].shape == (media.N_MELS, 1001)
            np.testing.assert_allclose(theirs, ours[i], rtol=0, atol=0.01, err_msg=f"{name} sample {i}")
    # the crops start at different places (the draws are used): a crop one hop off is far from equal
    starts = [media._indices("audio", "flac", 0, i, 0) for i in range(4)]
    assert len({round(u * 32000) for u in starts}) == 4
    moved = media._logmel_torch(media._crop_audio(np.roll(media._pyav_audio(media._read(*ts.members[0][:3])), -160),
                                                  starts[0])).numpy()
    assert np.abs(moved - ours[0]).max() > 1.0
