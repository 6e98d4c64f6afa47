"""Log-mel features (`gdsload.decode.audio._LogMel`) against a plain float64 reference.

The reference is the module docstring's steps written the direct way: the waveform zero-padded to
its length, `numpy.pad` (reflect, or zeros when it is not longer than n_fft // 2), every frame
windowed and transformed in float64, `|X|^2`, the dense mel matrix, `10 log10(max(x, 1e-10))`.
The decoder's version (blocks of frames, float32 power and sums, frames past the recording not
computed) must stay within `TOL_DB` of it everywhere, -100 dB silence included.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gdsload.decode.audio import LOGMEL_BLOCK, AudioDecoder, AudioTransform, _LogMel, decode_nbytes, mel_filters

TOL_DB = 1e-4  # measured: <= 1.5e-5 dB


def reference(seg: np.ndarray, n: int, t: AudioTransform) -> np.ndarray:
    wave = np.zeros(n)
    wave[: min(len(seg), n)] = seg[:n]
    pad = t.n_fft // 2
    x = np.pad(wave, (pad, pad), mode="reflect" if n > pad else "constant")
    frames = np.lib.stride_tricks.sliding_window_view(x, t.n_fft)[:: t.hop]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(t.n_fft) / t.n_fft)
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    fb = mel_filters(t.sample_rate, t.n_fft, t.n_mels).astype(np.float64)
    return 10 * np.log10(np.maximum(fb @ power.T, 1e-10))


def signal(m: int, seed: int, scale: float = 0.5) -> np.ndarray:
    """A tone plus noise (a wide range of levels across the bins)."""
    rng = np.random.default_rng(seed)
    tone = np.sin(2 * np.pi * 440 * np.arange(m) / 16000)
    return (scale * (tone + 0.05 * rng.standard_normal(m))).astype(np.float32)


def features(t: AudioTransform, seg: np.ndarray, n: int) -> np.ndarray:
    dst = np.full((t.n_mels, 1 + n // t.hop), np.nan, np.float32)
    _LogMel(t)(seg, n, dst)
    return dst


# (n_fft, hop, n_mels): the default; 80 mels over 33 bins (filters narrower than a bin: -100 dB);
# a power-of-two FFT
CONFIGS = [(400, 160, 80), (64, 16, 80), (512, 128, 64)]


@pytest.mark.parametrize("n_fft,hop,n_mels", CONFIGS)
@pytest.mark.parametrize("n,m,scale", [
    (16000, 16000, 0.5),  # a full crop
    (16000, 16000, 1e-4),  # quiet
    (16000, 9000, 0.5),  # a short recording: zeros from 9,000 (frames past it not computed)
    (16000, 16000 - 40, 0.5),  # ends inside the last frames' windows
    (16000, "n - pad", 0.5),  # the last frame's only samples are in its reflected padding
    (20 * LOGMEL_BLOCK * 16 + 7, 20 * LOGMEL_BLOCK * 16 + 7, 0.5),  # several blocks, a partial last one
    (16000, 0, 0.5),  # nothing decoded: all silent
    (100, 100, 0.5),  # shorter than a frame
    (10, 10, 0.5),  # not longer than n_fft // 2: zero padding, as torch would refuse reflect
])
def test_matches_the_float64_reference(n_fft: int, hop: int, n_mels: int, n: int, m: int | str, scale: float) -> None:
    t = AudioTransform(features="logmel", n_fft=n_fft, hop=hop, n_mels=n_mels)
    if m == "n - pad":
        m = n - n_fft // 2
    seg = signal(m, seed=n + m, scale=scale)
    got = features(t, seg, n)
    ref = reference(seg, n, t)
    assert got.shape == ref.shape == (n_mels, 1 + n // hop)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL_DB)
    assert (ref > -99).any() == (m > 0)  # the cases are not all silence


def test_frames_past_the_recording_are_silent_and_the_rest_unchanged() -> None:
    """A 10 s crop of a 3 s recording: the frames whose window holds no sample are -100 dB (not
    computed), the last one that holds one is not, and all are those of the zero-padded waveform
    given whole."""
    t = AudioTransform(features="logmel")
    seg = signal(48000, seed=1)
    got = features(t, seg, 160000)
    padded = np.zeros(160000, np.float32)
    padded[:48000] = seg
    (whole,) = AudioDecoder(t, batch_size=1).features([padded])
    last = (48000 + t.n_fft // 2 - 1) // t.hop  # the last frame whose window reaches a sample
    np.testing.assert_allclose(got[:, last + 1 :], -100, rtol=0, atol=TOL_DB)
    assert (got[:, last] > -99).any()
    np.testing.assert_allclose(got, whole, rtol=0, atol=TOL_DB)


def test_threads_have_their_own_buffers() -> None:
    """Two threads computing different recordings at once get what one thread gets."""
    t = AudioTransform(features="logmel", seconds=1.0)
    lm = _LogMel(t)
    segs = [signal(16000, seed=s, scale=0.1 * (s + 1)) for s in range(8)]
    want = [features(t, s, 16000) for s in segs]
    got: dict[tuple[int, int], np.ndarray] = {}

    def work(k: int) -> None:
        for rep in range(5):
            for i in range(k, len(segs), 2):
                dst = np.empty((t.n_mels, 101), np.float32)
                lm(segs[i], 16000, dst)
                got[i, rep] = dst

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert len(got) == 40
    for (i, _), g in got.items():
        np.testing.assert_array_equal(g, want[i])


def test_the_memory_budget_counts_the_buffers() -> None:
    """`decode_nbytes` counts two reader threads' log-mel buffers: what a thread allocates."""
    t = AudioTransform(features="logmel", seconds=2.0)
    lm = _LogMel(t)
    lm(signal(32000, seed=0), t.samples, np.empty((t.n_mels, 1 + t.samples // t.hop), np.float32))
    held = sum(b.nbytes for b in lm._local.b)
    assert held == _LogMel.nbytes(t)
    no_features = AudioTransform(seconds=2.0)
    assert decode_nbytes(t, 4) - decode_nbytes(no_features, 4) == 2 * held


def test_odd_n_fft_is_refused() -> None:
    """An odd n_fft gives one frame fewer than (n_mels, 1 + samples // hop) (torch.stft's count):
    refused when the transform is made, not a shape error in a reader thread."""
    with pytest.raises(ValueError, match=r"n_fft=401.*even"):
        AudioTransform(features="logmel", n_fft=401)
    AudioTransform(n_fft=401)  # unused without features
