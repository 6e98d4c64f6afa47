"""Audio: `AudioTransform` and the `AudioDecoder` a loader runs per batch.

Decoding resamples to `sample_rate` (and downmixes with `mono=True`): DALI's `fn.decoders.audio`
(libsndfile: WAV, FLAC, Ogg Vorbis/Opus) where it decodes the codec, PyAV (the `media` extra) for
MP3, AAC and the rest, both as float32 in [-1, 1]. Then a fixed length of `seconds`: a longer
waveform is cropped ("random": start drawn from the seeded plan, the same after a resume;
"start"; "center"), a shorter one padded with zeros at the end; `"<field>.length"` holds the
valid length (samples, or feature frames with `features="logmel"`). A recording longer than
`max_seconds` (from the index, probed at conversion) is refused before decoding.

Long recordings: only the crop's window is decoded. A recording is decoded whole, as always,
while the decode holds at most `WHOLE_FACTOR` times (the output plus one second) of samples: its
source samples (all channels) and its resampled ones; a longer one goes through `_pyav_window`.
The crop's start comes from the length the whole decode gives (`whole_length`: the index's
source samples at the output rate, rounded up as DALI's resampler does), so it is the same clip
for the same seed, epoch and sample; lossy codecs' indexes count the encoder's delay and padding,
so `LOSSY_SLACK` source samples are taken off theirs (their crops can sit that much earlier than
a whole decode's would, and never run past the end). PyAV decodes the source from a little
before the window to a little after it (`MARGIN` output samples of filter context on each side,
from a start on both rates' grid and on DALI's 256-sample resampling blocks, `_grid`), and only
that part is resampled, by the whole decode's resampler: DALI's `fn.audio_resample` for the codecs
DALI decodes (the one `fn.decoders.audio` runs, after a downmix by the mean, as it does), FFmpeg's
for the rest. The window is then the whole decode's samples bit for bit (FLAC, WAV, MP3; Opus
within 1e-5: FFmpeg's decoder against libsndfile's; the tests check each), at the recording's
start and end too. Sample positions: the codecs DALI decodes by the frames' timestamps (FLAC
frame numbers, WAV offsets, Ogg granule positions; DALI keeps Opus's 312-sample pre-skip, FFmpeg
drops it, so a window starting in it has zeros there; a gap in the timestamps is a frame FFmpeg
skipped as corrupt, an error, as DALI refuses such a file), seeking in FLAC, WAV and Ogg from
`PREROLL_S` before the window (a seek that lands after the window's start falls back to decoding
from the start); MP3, AAC and the rest by counting samples from the start, without a seek (their
timestamps after a seek are estimates in VBR files): memory stays bounded, time grows with the
window's position. Memory per recording: the output window and, for DALI's resampler, its source
samples (the window, its margins and grid, at the source rate); never the recording
(`decode_nbytes`). Corruption outside the window is not seen. A recording that ends before its
window (shorter than its index says: truncated or corrupt) is an error naming both lengths, under
`on_error`.

`features="logmel"`: log-mel features (N, n_mels, 1 + samples // hop): a Hann-windowed STFT of
`n_fft` points every `hop` samples (centred, reflect-padded, as `torch.stft(center=True)`), power
spectrum, an HTK mel filter bank from 0 Hz to Nyquist (triangles of height 1, `mel_filters`),
then `10 * log10(max(x, 1e-10))`. Computed with NumPy (`_LogMel`) on the cropped waveform, in
the reader thread that decodes the batch, in that thread's buffers: the crop goes straight into
a float64 buffer with the padding (no zero-filled copy, no `numpy.pad`); frames are windowed and
transformed (`numpy.fft.rfft`, float64) `LOGMEL_BLOCK` at a time, so a block stays in cache
between the product and the FFT; the squared real and imaginary parts of every bin are kept side
by side in float32; each filter is one float32 product over its band of that array (a filter
spans <= 14 of 201 bins: 80 small products, no BLAS threads); frames past the last nonzero
sample (a recording shorter than the crop) are not computed: they are silent, -100 dB. Within
2e-5 dB of the same steps in float64 (tests/decode/test_logmel.py; the float32 sums have no
cancellation: every term is positive) and 0.5 dB of `torch.stft`'s (tests/test_media.py).
Measured here (thread CPU on a shared 2-core VM, indicative only): 10 s of a bench FLAC recording
in ~1.8-2.1 ms against ~2.8 for the version before (fresh zero-filled and padded copies of each
crop, float64 spectrum and sums, each filter over a stride-2 view); NumPy 2's float32 `rfft` takes
2.5-2.7 ms for the 1,001 frames against 0.7 ms in float64, hence the float64 FFT (torch's float32
`rfft`, 0.18 ms, is not a dependency of decoding). DALI has these steps too (`fn.spectrogram`,
`fn.mel_filter_bank`, `fn.to_decibels`), and they were the first implementation: 6.7 ms of CPU
per 10 s recording, and as a second pipeline under the decoder's lock they left one reader thread
waiting for the other (10 s log-mel from FLAC: 92 recordings/s, below torch DataLoader + PyAV).

Threads: the DALI decoding pipeline (and the windows' resampling one) runs under a lock (it is
short: ~1 ms of a 10 s FLAC recording); PyAV decodes and the features are computed outside it, in parallel across reader
threads (NumPy's FFT, matrix product and ufuncs release the GIL). Under the lock, each whole
decode is cut to its crop and copied into rows of the calling reader thread (`_keep`: batch x the
output's samples, float32, reused batch after batch; DALI's outputs are only valid until its next
run), not copied whole into a fresh array (whose first-touched pages cost more than the copy).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gdsload.decode.media import DALI_AUDIO, probe
from gdsload.errors import DecodeError, require

MAX_SECONDS = 3600.0  # default limit on a recording's length
SALT = 0x6175  # draws(...) salt of audio crops
#: A recording is decoded whole while its source samples (all channels) plus its resampled
#: samples are at most this many times (the output's samples + one second of output); longer
#: ones decode only the crop's window (module docstring). 10 s log-mel from 12 s recordings stay
#: whole: DALI decodes a whole 12 s FLAC in 1.7 ms of CPU, PyAV a 10 s window in 3.2 ms (here).
WHOLE_FACTOR = 4
#: Output samples decoded and resampled on each side of a resampled window, then dropped: more
#: than the resamplers' reach (DALI's 16 lobes at quality 50, FFmpeg's 32 taps, both scaled by
#: the rate ratio), so the window's samples are those of the whole decode.
MARGIN = 256
#: Source seconds decoded before a window after a seek (dropped): lossy decoders (Opus, Vorbis)
#: converge within 80 ms; a seek lands at or before its target.
PREROLL_S = 0.25
#: Source samples the index may count beyond what a lossy decoder returns (MP3's encoder delay
#: and padding, up to ~2,300; AAC's, 2,048; Opus's pre-skip and last frame, ~1,300)
LOSSY_SLACK = 4096
#: Containers whose timestamps after a seek are exact sample positions: FLAC frame numbers, WAV
#: byte offsets, Ogg granule positions. Others are decoded from the start up to the window's end.
SEEK_FORMATS = frozenset({"flac", "wav", "ogg"})


@dataclass(frozen=True)
class AudioTransform:
    """Fixed-length waveforms (N, samples) (mono; (N, channels, samples) with `mono=False`) or
    log-mel features (N, n_mels, frames), and `"<field>.length"`; see the module docstring."""

    sample_rate: int = 16000
    seconds: float = 10.0
    crop: Literal["random", "start", "center"] = "random"
    mono: bool = True
    features: Literal["logmel"] | None = None
    n_mels: int = 80
    n_fft: int = 400
    hop: int = 160
    max_seconds: float | None = MAX_SECONDS
    channels: int = 2  # with mono=False: output channels (fewer are zero-padded, more refused)

    kind = "audio"

    def __post_init__(self) -> None:
        if self.crop not in ("random", "start", "center"):
            raise ValueError(f"AudioTransform(crop={self.crop!r}): 'random', 'start' or 'center'")
        if self.features not in (None, "logmel"):
            raise ValueError(f"AudioTransform(features={self.features!r}): None or 'logmel'")
        if self.features and not self.mono:
            raise ValueError("AudioTransform(features='logmel') needs mono=True")
        if not (self.sample_rate > 0 and self.seconds > 0 and self.n_fft > 0 and self.hop > 0 and self.n_mels > 0):
            raise ValueError("AudioTransform: sample_rate, seconds, n_fft, hop and n_mels must be positive")
        if self.features and self.n_fft % 2:  # 1 + samples // hop frames (torch.stft gives one fewer for odd n_fft)
            raise ValueError(f"AudioTransform(n_fft={self.n_fft}): features='logmel' needs an even n_fft")

    @property
    def samples(self) -> int:
        return round(self.sample_rate * self.seconds)

    @property
    def dtype(self) -> str:
        return "float32"

    def output_shape(self, hw: Any = None) -> tuple[int, ...]:
        if self.features:
            return (self.n_mels, 1 + self.samples // self.hop)
        return (self.samples,) if self.mono else (self.channels, self.samples)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "audio", **{k: getattr(self, k) for k in self.__dataclass_fields__}}


def whole_length(meta: dict, rate: int) -> int:
    """Samples at `rate` of the whole decode of a recording whose index metadata is `meta`
    (source samples and rate): DALI's resampler gives ceil(samples * rate / source rate). Exact
    for FLAC and PCM; for lossy codecs the index counts the encoder's delay and padding, which the
    decoders drop, so `LOSSY_SLACK` source samples are taken off: a window never runs past the end."""
    n, src = int(meta["samples"]), int(meta["sample_rate"])
    if not (meta.get("codec") == "flac" or str(meta.get("codec", "")).startswith("pcm_")):
        n = max(0, n - LOSSY_SLACK)
    return n if src == rate else -(-n * rate // src)


def crop_start(t: AudioTransform, n: int, u: float) -> int:
    """The crop's first output sample in a waveform of `n` samples (`u`: the plan's draw)."""
    room = max(0, n - t.samples)
    return min({"random": int(u * (room + 1)), "start": 0, "center": room // 2}[t.crop], room)


def decode_nbytes(t: AudioTransform, batch_size: int) -> int:
    """Upper bound of the bytes decoding a batch holds beyond its output (the feed server's
    budget counts it): per recording, a whole decode's source and resampled samples (at most
    `WHOLE_FACTOR` x (output + 1 s) of float32), twice for DALI's own buffers (the crops copied out
    of them, `_keep`, batch x output per reader thread, fit in that second half); a window holds its
    output and its source samples (the window and <= 8 s of grid, usually 0.1 s, at the source
    rate: within the same bound while the source rate is up to ~3x the output's); plus log-mel
    buffers (`_LogMel.nbytes`) of two reader threads (the server's default)."""
    oc = 1 if t.mono else t.channels
    feats = 2 * _LogMel.nbytes(t) if t.features else 0
    return batch_size * 2 * WHOLE_FACTOR * (t.samples + t.sample_rate) * oc * 4 + feats


class _View:
    """A member's bytes as the file PyAV reads (in place: a long recording is not copied)."""

    def __init__(self, data: np.ndarray):
        self._m = memoryview(np.ascontiguousarray(data)).cast("B")
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        a = self._pos
        self._pos = len(self._m) if n < 0 else min(len(self._m), a + n)
        return self._m[a : self._pos].tobytes()

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else len(self._m) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True


def _grid(src: int, rate: int) -> int | None:
    """The step (output samples) of the starts a window's resampling may take: on both rates'
    common grid (a whole number of samples at each) and a multiple of 256, the output block of
    DALI's resampler (within a block it adds the source step in float32: a window that starts
    mid-block differs by up to 2.4e-5 from the whole decode; measured). None when that step is
    over 8 s of output (rates with no common grid: e.g. 44,101 Hz)."""
    up = rate // math.gcd(src, rate)
    unit = math.lcm(up, 256)
    return unit if unit <= 8 * rate else None


_RFFT_OUT = np.lib.NumpyVersion(np.__version__) >= "2.0.0"  # numpy.fft.rfft(out=...)
_SCALE = {"s16": 2.0**-15, "s32": 2.0**-31, "flt": 1.0, "dbl": 1.0}


def _floats(f: Any, channels: int) -> np.ndarray:
    """A decoded frame as float32 (samples, channels) in [-1, 1], as DALI converts (x / 2^15
    for 16-bit, x / 2^31 for 32-bit, (x - 128) / 128 for unsigned 8-bit)."""
    a = f.to_ndarray()
    x = a.T if f.format.is_planar else a.reshape(-1, channels)
    name = f.format.name.rstrip("p")
    if name == "u8":
        return (x.astype(np.float32) - 128) / 128
    if name not in _SCALE:
        raise ValueError(f"audio sample format {f.format.name!r} is not supported")
    x = x.astype(np.float32)
    return x * np.float32(_SCALE[name]) if _SCALE[name] != 1.0 else x


@dataclass
class _Pending:
    """A window's source samples for DALI's resampler: `src` (samples,) or (samples, channels)
    at `rate`; the window starts `offset` output samples into its resampled output."""

    src: np.ndarray
    rate: int
    offset: int


def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) triangular HTK mel filters, 0 Hz to Nyquist."""
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
    hz = lambda m: 700.0 * (10 ** (m / 2595.0) - 1.0)
    pts = hz(np.linspace(mel(0.0), mel(sample_rate / 2), n_mels + 2))
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lo, c, hi = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    return np.maximum(0, np.minimum((bins - lo) / (c - lo), (hi - bins) / (hi - c))).astype(np.float32)


#: Frames per block of the log-mel STFT: a block's windowed frames and spectrum (64 x 400 float64
#: and 64 x 201 complex128: 0.2 MB each) are reused block after block, in cache (64 and 128 were
#: the fastest of 32-1,024 for 10 s at n_fft 400 here; 1,024: ~8 % slower).
LOGMEL_BLOCK = 64


class _LogMel:
    """Log-mel features as the module docstring says: `(seg, n, dst)` writes the features of
    `seg` zero-padded to `n` samples into `dst` (n_mels, 1 + n // hop), in buffers of the calling
    thread (made on its first call, grown as needed)."""

    def __init__(self, t: AudioTransform):
        self.n_fft, self.hop, self.n_mels = t.n_fft, t.hop, t.n_mels
        self.bins = t.n_fft // 2 + 1
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(t.n_fft) / t.n_fft)  # periodic Hann, float64
        fb = mel_filters(t.sample_rate, t.n_fft, t.n_mels)
        # each filter as its band of bins (a triangle: contiguous) in the interleaved spectrum
        # (re^2, im^2 of each bin, side by side), its weights twice; an empty filter (narrower
        # than a bin) has no band and stays 0 (-100 dB), not a neighbour's value
        self.bands: list[tuple[int, int, int, np.ndarray]] = []
        self.empty: list[int] = []
        for m in range(t.n_mels):
            nz = np.flatnonzero(fb[m])
            if len(nz):
                self.bands.append((m, 2 * int(nz[0]), 2 * (int(nz[-1]) + 1), np.repeat(fb[m, nz[0] : nz[-1] + 1], 2)))
            else:
                self.empty.append(m)
        self._local = threading.local()

    @staticmethod
    def nbytes(t: AudioTransform) -> int:
        """Bytes of one thread's buffers for `t`'s waveforms (`t.samples`): the padded waveform
        (float64), a block's windowed frames (float64) and spectrum (complex128), and the squared
        spectrum of every frame (float32)."""
        frames, bins = 1 + t.samples // t.hop, t.n_fft // 2 + 1
        return (t.samples + t.n_fft) * 8 + LOGMEL_BLOCK * (t.n_fft * 8 + bins * 16) + frames * bins * 2 * 4

    def _buffers(self, n: int, frames: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        b = getattr(self._local, "b", None)
        if b is None or len(b[0]) < n + 2 * (self.n_fft // 2) or len(b[3]) < frames:
            n0, f0 = (len(b[0]), len(b[3])) if b is not None else (0, 0)
            block = LOGMEL_BLOCK
            b = (np.empty(max(n0, n + 2 * (self.n_fft // 2))),  # the padded waveform, float64
                 np.empty((block, self.n_fft)),  # a block's windowed frames
                 np.empty((block, self.bins), np.complex128),  # their spectrum
                 np.empty((max(f0, frames), 2 * self.bins), np.float32))  # re^2, im^2 of every frame
            self._local.b = b
        return b

    def __call__(self, seg: np.ndarray, n: int, dst: np.ndarray) -> None:
        N, hop, pad = self.n_fft, self.hop, self.n_fft // 2
        F = 1 + n // hop
        m = min(len(seg), n)
        xp_, fw, spec, power = self._buffers(n, F)
        xp = xp_[: n + 2 * pad]
        # the waveform zero-padded to n, then padded by n_fft // 2 on each side: reflected (as
        # torch.stft(center=True, pad_mode="reflect")) when longer than that, else zeros
        xp[pad : pad + m] = seg[:m]
        xp[pad + m : pad + n] = 0.0
        reflect = n > pad
        if reflect:
            xp[:pad] = xp[2 * pad : pad : -1]
            xp[pad + n :] = xp[pad + n - 2 : n - 2 : -1]  # n > pad >= 1 (n_fft is even)
        else:
            xp[:pad] = 0.0
            xp[pad + n :] = 0.0
        # frames past the last nonzero sample are silent: -100 dB, not computed
        end = n + 2 * pad if reflect and m > n - 1 - pad else pad + m
        need = min(F, -(-end // hop))
        frames = np.lib.stride_tricks.sliding_window_view(xp, N)[::hop]  # a view: (F, n_fft)
        for a in range(0, need, len(fw)):
            b = min(need, a + len(fw))
            w = fw[: b - a]
            np.multiply(frames[a:b], self.window, out=w)
            if _RFFT_OUT:
                s = spec[: b - a]
                np.fft.rfft(w, axis=-1, out=s)
            else:
                s = np.fft.rfft(w, axis=-1)
            np.square(s.view(np.float64), out=power[a:b])
        p = power[:need]
        for k, lo, hi, wt in self.bands:  # one small product per filter over its band, float32
            np.matmul(p[:, lo:hi], wt, out=dst[k, :need])
        if self.empty:
            dst[self.empty, :need] = 0.0
        dst[:, need:] = 0.0
        np.maximum(dst, 1e-10, out=dst)
        np.log10(dst, out=dst)
        dst *= 10.0


class AudioDecoder:
    def __init__(self, transform: AudioTransform, *, batch_size: int, threads: int = 2,
                 on_error: Literal["raise", "skip"] = "raise"):
        self.t = transform
        self.batch_size = batch_size
        self.threads = threads
        self.on_error = on_error
        self.skipped = 0
        self._pipe = None
        self._rpipe = None  # DALI's resampler for windows of long recordings, built on first use
        self._logmel = _LogMel(transform) if transform.features else None
        self._staging = threading.local()  # each reader thread's rows for DALI's outputs (`_keep`)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool = None  # PyAV decodes, `threads` at a time
        self._counted = threading.Lock()
        #: source samples (per channel) decoded: whole recordings, or windows with their margins
        self.samples_decoded = 0
        self.windows = 0  # recordings decoded as a window only

    def features(self, waves: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-mel features (n_mels, 1 + len // hop) of mono float32 waveforms."""
        lm = self._logmel or _LogMel(self.t)
        out = []
        for w in waves:
            dst = np.empty((self.t.n_mels, 1 + len(w) // self.t.hop), np.float32)
            lm(np.asarray(w, np.float32), len(w), dst)
            out.append(dst)
        return out

    def _build(self) -> None:
        require("nvidia.dali", extra="cpu", purpose="audio decoding")
        from nvidia.dali import fn, pipeline_def, types

        from gdsload.decode.image import _BUILT

        t = self.t

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            a, _ = fn.decoders.audio(enc, sample_rate=float(t.sample_rate), downmix=t.mono, dtype=types.FLOAT)
            return a

        self._pipe = pipe()
        self._pipe.build()
        _BUILT.add(self._pipe)
        self._pid = os.getpid()

    def _build_resample(self) -> None:
        require("nvidia.dali", extra="cpu", purpose="audio decoding")
        from nvidia.dali import fn, pipeline_def, types

        from gdsload.decode.image import _BUILT

        t = self.t

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        def pipe():
            src = fn.external_source(name="src", dtype=types.FLOAT, ndim=1 if t.mono else 2)
            rate = fn.external_source(name="rate", dtype=types.FLOAT, ndim=0)
            return fn.audio_resample(src, in_rate=rate, out_rate=float(t.sample_rate), quality=50.0)

        self._rpipe = pipe()
        self._rpipe.build()
        _BUILT.add(self._rpipe)
        self._rpid = os.getpid()

    def _dali_resample(self, items: list[tuple[int, _Pending]]) -> dict[int, Any]:
        """Windows' source samples through DALI's resampler (the one `fn.decoders.audio` runs, at
        its default quality 50), cut to their window."""
        L = self.t.samples
        out: dict[int, Any] = {}
        with self._lock:
            if self._rpipe is None or self._rpid != os.getpid():
                self._build_resample()
            try:
                self._rpipe.feed_input("src", [w.src for _, w in items])
                self._rpipe.feed_input("rate", [np.float32(w.rate) for _, w in items])
                (res,) = self._rpipe.run()
            except RuntimeError as exc:
                from gdsload.decode.image import dali_reason

                self._rpipe = None
                return {i: ValueError(dali_reason(exc)) for i, _ in items}
            for k, (i, w) in enumerate(items):
                out[i] = self._keep(i, np.asarray(res[k])[w.offset : w.offset + L])
        return out

    def _keep(self, i: int, x: np.ndarray) -> np.ndarray:
        """`x`, a view of a DALI output (valid until that pipeline's next run, by any thread), copied
        into row `i` of this thread's staging rows (batch_size x the output's samples and channels,
        float32, made once per thread and reused: a fresh array per recording cost ~0.4 ms of page
        faults for 12 s at 16 kHz, 10 times the copy, here). Read before this thread's next batch."""
        width = self.t.samples * (1 if self.t.mono else self.t.channels)
        if x.size > width:  # not a crop (none is longer than the output)
            return x.copy()
        st = getattr(self._staging, "rows", None)
        if st is None or len(st) <= i:
            st = self._staging.rows = np.empty((max(i + 1, self.batch_size), width), np.float32)
        y = st[i, : x.size].reshape(x.shape)
        y[...] = x
        return y

    def _pyav_window(self, data: np.ndarray, meta: dict, start: int, *, seek: bool = True) -> Any:
        """Output samples [start, start + seconds) of a long recording (fewer where it ends): an
        array as `_pyav_decode` returns, or a `_Pending` window for DALI's resampler (a codec DALI
        decodes, at another rate). See the module docstring."""
        import av

        t = self.t
        L, r = t.samples, t.sample_rate
        dali = meta["codec"] in DALI_AUDIO
        decoded = 0
        try:
            with av.open(_View(data), "r") as c:
                s = c.streams.audio[0]
                R, C = int(s.codec_context.sample_rate), int(s.codec_context.channels)
                if R == r:  # nothing resampled: exactly the window
                    s0 = o0 = start
                    s1 = start + L
                else:  # from a sample on both rates' grid, with the filters' context on both sides
                    unit = _grid(R, r)
                    if unit is None:  # no grid within seconds: FFmpeg's resampler from the start
                        dali = seek = False
                        unit = 1 << 62
                    k = max(0, start - MARGIN) // unit
                    s0, o0 = k * unit * R // r, k * unit
                    s1 = -(-(start + L + MARGIN) * R // r)
                tb = s.time_base
                pre = int(PREROLL_S * R)
                seeking = seek and dali and c.format.name in SEEK_FORMATS and s0 - pre > R and tb
                if seeking:
                    from fractions import Fraction

                    c.seek(int(Fraction(s0 - pre, R) / tb), stream=s, backward=True)
                # DALI's codecs: the window's source samples (downmixed first, as DALI does), placed
                # by timestamp; the rest: FFmpeg's resampler over the window, samples counted
                oc = 1 if t.mono else C
                buf = np.zeros((s1 - s0, oc), np.float32) if dali else None
                layout = "mono" if t.mono else ("stereo" if C >= 2 else "mono")
                rs = None if dali else av.AudioResampler(format="flt", layout=layout, rate=r)
                out = None if dali else np.zeros((L, 1 if layout == "mono" else 2), np.float32)
                want = start - o0  # the window's first sample in the resampled output
                got = filled = 0  # resampled samples out (FFmpeg path); samples written
                pos = end = 0
                first = True

                def take(g: Any) -> None:  # FFmpeg's resampled output: keep the window's part
                    nonlocal got, filled
                    y = g.to_ndarray().reshape(-1, out.shape[1])
                    a, b = max(want - got, 0), min(want + L - got, len(y))
                    if b > a:
                        out[got + a - want : got + b - want] = y[a:b]
                        filled = max(filled, got + b - want)
                    got += len(y)

                for f in c.decode(s):
                    n = f.samples
                    p = round(f.pts * tb * R) if dali and f.pts is not None and tb else pos
                    if seeking and first and p > s0:  # landed after the window: from the start
                        return self._pyav_window(data, meta, start, seek=False)
                    if not first and p > pos:  # FFmpeg skips a frame that fails its check; DALI refuses the file
                        raise ValueError(f"corrupt audio: {p - pos} samples missing at {pos / R:.2f} s "
                                         f"(a frame does not decode)")
                    first = False
                    pos = p + n
                    decoded += n
                    if pos <= s0:
                        continue
                    a, b = max(s0 - p, 0), min(s1 - p, n)
                    if b > a:
                        if dali:
                            x = _floats(f, C)[a:b]
                            if t.mono:
                                x = x.mean(axis=1, keepdims=True, dtype=np.float32)
                            buf[p + a - s0 : p + b - s0] = x
                        else:
                            if (a, b) != (0, n):
                                arr = f.to_ndarray()
                                arr = arr[:, a:b] if f.format.is_planar else arr[:, a * C : b * C]
                                f = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=f.format.name,
                                                               layout=f.layout.name)
                                f.sample_rate = R
                            for g in rs.resample(f):
                                take(g)
                        end = max(end, p + b)
                    if pos >= s1:
                        break
                if seeking and first:  # nothing after the seek: from the start
                    return self._pyav_window(data, meta, start, seek=False)
                if rs is not None:
                    for g in rs.resample(None):
                        take(g)
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt audio: {exc}") from None
        finally:
            with self._counted:
                self.samples_decoded += decoded
        if end <= start * R // r:  # nothing of the window itself (margins aside)
            raise ValueError(f"the recording ends at {pos / R:.2f} s, before its crop at {start / r:.2f} s "
                             f"(the index says {meta.get('duration', 0):.2f} s): truncated or corrupt")
        if not dali:
            x = out[:filled]
            return x[:, 0] if t.mono else x
        src = buf[: end - s0]
        if t.mono:
            src = src[:, 0]
        if R == r:
            return src
        return _Pending(src, R, want)

    def _run(self, enc: list) -> list[np.ndarray]:
        """DALI's decodes of `enc`: views of its outputs, valid until its next run."""
        if self._pipe is None or self._pid != os.getpid():
            self._build()
        self._pipe.feed_input("enc", enc)
        (res,) = self._pipe.run()
        return [np.asarray(res[k]) for k in range(len(enc))]

    def _dali_decode(self, items: list[tuple[int, np.ndarray]], u: np.ndarray | None = None) -> dict[int, Any]:
        """Whole decodes by DALI, each cut to its crop (`crop_start` from its length and row i's
        draw `u[i, 0]`) under the lock, into this thread's staging rows (`_keep`); without `u`,
        whole (a copy of each)."""
        out: dict[int, Any] = {}
        if not items:
            return out
        t = self.t

        def crop(i: int, x: np.ndarray) -> np.ndarray:
            if u is None:
                return x.copy()
            start = crop_start(t, x.shape[0], u[i, 0])
            return self._keep(i, x[start : start + t.samples])

        with self._lock:
            try:
                for i, a in zip([i for i, _ in items], self._run([e for _, e in items])):
                    out[i] = crop(i, a)
                return out
            except RuntimeError:
                self._pipe = None
            for i, e in items:
                try:
                    out[i] = crop(i, self._run([e])[0])
                except RuntimeError as exc:
                    from gdsload.decode.image import dali_reason

                    self._pipe = None
                    out[i] = ValueError(dali_reason(exc))
        return out

    def _pyav_decode(self, data: np.ndarray) -> np.ndarray:
        """(samples,) or (samples, channels) float32 at the transform's rate."""
        import av

        t = self.t
        parts = []
        decoded = 0
        try:
            with av.open(_View(data), "r") as c:
                s = c.streams.audio[0]
                layout = "mono" if t.mono else ("stereo" if s.codec_context.channels >= 2 else "mono")
                rs = av.AudioResampler(format="flt", layout=layout, rate=t.sample_rate)
                for f in c.decode(s):
                    decoded += f.samples
                    for g in rs.resample(f):
                        parts.append(g.to_ndarray().reshape(-1, 1 if layout == "mono" else 2))
                for g in rs.resample(None):
                    parts.append(g.to_ndarray().reshape(-1, 1 if layout == "mono" else 2))
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt audio: {exc}") from None
        finally:
            with self._counted:
                self.samples_decoded += decoded
        if not parts:
            raise ValueError("no audio frame decodes")
        x = np.concatenate(parts)
        return x[:, 0] if t.mono else x

    def close(self) -> None:
        """Stop the PyAV thread pool (the DALI pipelines go with the decoder)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode_into(self, encoded: Sequence[np.ndarray], names: Sequence[str], metas: Sequence[dict | None],
                    u: np.ndarray, dst: np.ndarray, length_dst: np.ndarray) -> list[int]:
        """Row i's waveform (or features) into `dst[i]`, its valid length into `length_dst[i]`."""
        t = self.t
        bad: list[tuple[int, str]] = []
        todo: dict[int, dict] = {}
        for i, (e, meta) in enumerate(zip(encoded, metas)):
            try:
                meta = meta or probe(e, "audio")
            except ValueError as exc:
                bad.append((i, str(exc)))
                continue
            if t.max_seconds is not None and meta.get("duration", 0) > t.max_seconds:
                bad.append((i, (f"{meta['duration']:.1f} s long, over the limit of {t.max_seconds} s "
                                f"(AudioTransform(max_seconds=...)); not decoded")))
                continue
            if not t.mono and meta.get("channels", 1) > t.channels:
                bad.append((i, f"{meta['channels']} channels, more than AudioTransform(channels={t.channels})"))
                continue
            todo[i] = meta
        # long recordings: only the crop's window (module docstring); its start from the length
        # the whole decode gives, so the same clip either way
        L, oc = t.samples, 1 if t.mono else t.channels
        windows: dict[int, int] = {}
        for i, meta in todo.items():
            if "samples" in meta and "sample_rate" in meta:
                n = whole_length(meta, t.sample_rate)
                if meta["samples"] * meta.get("channels", 1) + n * oc > WHOLE_FACTOR * (L + t.sample_rate) * oc:
                    windows[i] = crop_start(t, n, u[i, 0])
        whole = [i for i, m in todo.items() if m["codec"] in DALI_AUDIO and i not in windows]
        got = self._dali_decode([(i, encoded[i]) for i in whole], u)  # already cropped
        with self._counted:
            self.samples_decoded += sum(int(todo[i].get("samples", 0)) for i in whole)
            self.windows += len(windows)
        rest = [i for i in todo if i not in got]
        if rest:  # PyAV (MP3, AAC, ..., windows): `threads` samples at a time, the GIL released in FFmpeg
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="gdsload-audio")

            def one(i: int) -> Any:
                try:
                    if i in windows:
                        return self._pyav_window(encoded[i], todo[i], windows[i])
                    return self._pyav_decode(encoded[i])
                except ValueError as exc:
                    return exc

            for i, r in zip(rest, self._pool.map(one, rest)):
                got[i] = r
        pending = [(i, w) for i, w in got.items() if isinstance(w, _Pending)]
        if pending:  # windows of DALI's codecs at another rate: DALI's resampler, one run
            got.update(self._dali_resample(pending))
        for i in todo:
            if isinstance(got[i], Exception):
                bad.append((i, str(got[i])))
        if bad and self.on_error == "raise":
            i, why = min(bad)
            raise DecodeError(f"cannot decode audio {names[i]} ({len(bad)} bad in this batch): {why}",
                              remedy="pass on_error='skip' to skip and count such samples")
        self.skipped += len(bad)
        kept = sorted(i for i in todo if not isinstance(got[i], Exception))
        for i in kept:
            x = got[i]
            if i in windows or i in whole:  # already the window, or cropped (_dali_decode)
                seg = x[:L]
            else:
                start = crop_start(t, x.shape[0], u[i, 0])
                seg = x[start : start + L]
            m = seg.shape[0]
            if t.features:
                self._logmel(seg, L, dst[i])  # seg zero-padded to L
                length_dst[i] = 1 + m // t.hop
            elif t.mono:
                dst[i, :m] = seg
                dst[i, m:] = 0
                length_dst[i] = m
            else:
                dst[i] = 0
                seg2 = seg.reshape(m, -1)
                dst[i, : seg2.shape[1], :m] = seg2.T
                length_dst[i] = m
        return kept
