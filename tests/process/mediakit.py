"""Media made here with PyAV for the pass tests: H.264 video (frame i grey at `level(i)`, so a
decoded frame names its source frame) with optional AAC stereo audio, at a constant or a variable
frame rate; FLAC tones. Small: 160x90 at 5 fps by default."""

from __future__ import annotations

import io
import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np

from gdsload.bench.mediagen import encode_audio, frame_of, level

__all__ = ["video", "flac", "level", "frame_of", "VFR_MS", "files", "assert_same_output", "cli_env"]


def video(seconds: float = 3.0, fps: int = 5, width: int = 160, height: int = 90, *, audio: bool = True,
          times_ms: list[int] | None = None, freq: float = 440.0) -> bytes:
    """MP4: H.264 frames (at `times_ms` when given: a variable frame rate) and, with `audio`, AAC
    stereo at 44.1 kHz of `seconds` (a tone of `freq` Hz)."""
    import av

    buf = io.BytesIO()
    n = len(times_ms) if times_ms is not None else round(seconds * fps)
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        v.options = {"preset": "ultrafast", "tune": "zerolatency"}
        if times_ms is not None:
            v.codec_context.time_base = Fraction(1, 1000)
        a = None
        if audio:
            a = c.add_stream("aac", rate=44100)
            a.layout = "stereo"
        for i in range(n):
            f = av.VideoFrame.from_ndarray(np.full((height, width, 3), level(i), np.uint8), format="rgb24")
            if times_ms is not None:
                f.pts, f.time_base = times_ms[i], Fraction(1, 1000)
            for p in v.encode(f):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        if a is not None:
            sr, total = 44100, round(seconds * 44100)
            t = np.arange(total) / sr
            x = (np.sin(2 * np.pi * freq * t) * 0.3).astype(np.float32)
            for s0 in range(0, total, 1024):
                seg = np.ascontiguousarray(np.stack([x[s0 : s0 + 1024]] * 2))
                fr = av.AudioFrame.from_ndarray(seg, format="fltp", layout="stereo")
                fr.sample_rate, fr.pts = sr, s0
                for p in a.encode(fr):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
    return buf.getvalue()


def flac(seconds: float = 2.0, sample_rate: int = 16000, freq: float = 440.0) -> bytes:
    return encode_audio("flac", seconds=seconds, sample_rate=sample_rate, freq=freq)


VFR_MS = [0, 100, 500, 600, 1500, 1700]  # a variable frame rate: frame i shown from VFR_MS[i]


def files(root: Path) -> dict[str, bytes]:
    """Every file under root, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_output(got: Path, want: Path) -> None:
    """The same files with the same bytes; the manifests differ only in their creation time."""
    g, w = files(got), files(want)
    assert sorted(g) == sorted(w)
    for name in w:
        if name != "manifest.json":
            assert g[name] == w[name], f"{name} differs"
    gm, wm = json.loads(g["manifest.json"]), json.loads(w["manifest.json"])
    gm["created"].pop("at"), wm["created"].pop("at")
    assert gm == wm


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment, with `extra` and the repository first on PYTHONPATH: what
    `python -m gdsload process ... --fn passfns:...` needs, run with tests/process as its cwd."""
    path = os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **extra, "PYTHONPATH": path}
