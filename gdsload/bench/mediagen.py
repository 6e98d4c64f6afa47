"""Video and audio made offline with PyAV (and `wave`), for the tests, the example and the media
benchmark: frame i of a video is uniformly grey at brightness `level(i)`, so a decoded frame tells
which source frame it is; audio is a tone (or, with `ramp=True`, a WAV whose sample i is i mod
30000, so crops can be located).

Encoders: H.264 (libx264 `ultrafast`), HEVC (libx265 `ultrafast`), VP9 and VP8 (libvpx with its
realtime settings: its defaults take minutes), MJPEG (JPEG frames), FLAC, Opus (in Ogg), MP3, WAV;
`h264_444` and `vp9_444` are 4:4:4 chroma (which NVDEC refuses: the GPU fakes' tests).
"""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np

VIDEO = {  # name -> (codec, container, pixel format, options)
    "h264": ("libx264", "mp4", "yuv420p", {"preset": "ultrafast", "tune": "zerolatency"}),
    "vp9": ("libvpx-vp9", "webm", "yuv420p", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}),
    "vp8": ("libvpx", "webm", "yuv420p", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}),
    "mjpeg": ("mjpeg", "avi", "yuvj420p", {}),
    "h264_444": ("libx264", "mp4", "yuv444p", {"preset": "ultrafast"}),
    "hevc": ("libx265", "mp4", "yuv420p", {"preset": "ultrafast", "x265-params": "log-level=error"}),
    "vp9_444": ("libvpx-vp9", "webm", "yuv444p", {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}),
}
EXT = {"h264": "mp4", "vp9": "webm", "vp8": "webm", "mjpeg": "avi", "h264_444": "mp4", "hevc": "mp4", "vp9_444": "webm"}


def level(i: int) -> int:
    """The brightness of frame i: 8 + 12 i, wrapping below 250 (20 distinct levels)."""
    return 8 + 12 * (i % 20)


def frame_of(mean: float) -> int:
    """The frame index (mod 20) whose `level` is nearest `mean`."""
    return round((mean - 8) / 12)


def encode_video(codec: str = "h264", frames: int = 20, width: int = 64, height: int = 48, fps: int = 10,
                 gop: int | None = None, pattern: Any = None) -> bytes:
    """A video whose frame i is grey at `level(i)` (or `pattern(i, h, w)`: an RGB uint8 frame)."""
    import av

    name, container, pix, opts = VIDEO[codec]
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as c:
        s = c.add_stream(name, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, pix
        if gop:
            s.codec_context.gop_size = gop
        s.options = dict(opts)
        for i in range(frames):
            a = pattern(i, height, width) if pattern else np.full((height, width, 3), level(i), np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def encode_audio(codec: str = "flac", seconds: float = 1.0, sample_rate: int = 16000, channels: int = 1,
                 freq: float = 440.0) -> bytes:
    """A tone of `seconds` as FLAC, Opus (Ogg), MP3 or WAV (`wave`: 16-bit PCM)."""
    n = round(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    x = (np.sin(2 * np.pi * freq * t) * 12000).astype(np.int16)
    x = np.repeat(x[None, :], channels, 0)
    if codec == "wav":
        return encode_wav(x, sample_rate)
    import av

    name, container, fmt = {"flac": ("flac", "flac", "s16"), "opus": ("libopus", "ogg", "s16"),
                            "mp3": ("libmp3lame", "mp3", "s16p")}[codec]
    layout = "mono" if channels == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as c:
        s = c.add_stream(name, rate=sample_rate)
        s.layout, s.format = layout, fmt
        for a in range(0, n, 960):
            seg = np.ascontiguousarray(x[:, a : a + 960].T.reshape(1, -1))  # packed s16
            f = av.AudioFrame.from_ndarray(seg, format="s16", layout=layout)
            f.sample_rate = sample_rate
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def encode_wav(x: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV of `x` ((channels, n) or (n,) int16)."""
    x = np.atleast_2d(np.asarray(x, np.int16))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(x.shape[0])
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.ascontiguousarray(x.T).tobytes())
    return buf.getvalue()


def ramp_wav(n: int, sample_rate: int = 16000) -> bytes:
    """A mono WAV whose sample i is i mod 30000 (int16): a crop's first value says where it began."""
    return encode_wav((np.arange(n) % 30000).astype(np.int16), sample_rate)
