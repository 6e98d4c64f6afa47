"""OCR and speech recognition over every video of a dataset with `gdsload.process` (stand-in models).

    python examples/preprocess_ocr_asr.py --shards shards/lectures --out passes/
    python examples/preprocess_ocr_asr.py --tiny            # makes a small dataset here first

Two passes over the same videos, each written as a new dataset:
- OCR: frames at 1 fps in windows of 8 (`frames=(1.0, 8)`, short side resized to 360), one
  `ocr.json` per window that shows text: for each frame with text, its time and text box.
- ASR: speech in 30 s chunks of 16 kHz mono (`speech=30`; `--tiny`: 2 s), one `asr.json` per
  chunk: its start time and the segments where someone speaks.

The models are stand-ins, so the example runs anywhere in seconds: "OCR" finds the box of bright
pixels (the tiny videos show a white caption on some frames), "ASR" marks 0.25 s frames whose
loudness is over a threshold as speech. Replace `StandInOCR`/`StandInASR` with a real model (a
class: gdsload instantiates it once per process, so the weights load once). Times in both passes
count from the container's start, so a caption at t and speech at t line up.

A pass is crash-safe: kill it and run it again with `resume=True` (CLI: `--resume`); it writes
every output exactly once. `--workers N` runs N processes (the same bytes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import gdsload


class StandInOCR:
    """Per window: the frames showing "text" (pixels over 200), with their time and box."""

    def __init__(self) -> None:
        self.threshold = 200  # a real model would load its weights here, once per process

    def __call__(self, batch: dict) -> list:
        out = []
        for frames, times in zip(batch["frames"], batch["t"]):
            found = []
            for img, t in zip(frames, times):
                if t < 0:  # padding at the video's end
                    continue
                ys, xs = np.nonzero(img.min(axis=2) > self.threshold)
                if len(ys):
                    found.append({"t": round(float(t), 3), "box": [int(xs.min()), int(ys.min()),
                                                                   int(xs.max()) + 1, int(ys.max()) + 1]})
            out.append({"ocr.json": found} if found else None)  # None: nothing written for the window
        return out


class StandInASR:
    """Per chunk: segments of 0.25 s frames louder than -30 dBFS, as (start, end) seconds."""

    frame = 4000  # samples at 16 kHz

    def __call__(self, batch: dict) -> list:
        out = []
        for audio, n, t in zip(batch["audio"], batch["length"], batch["t"]):
            x = audio[: n - n % self.frame].reshape(-1, self.frame)
            loud = 20 * np.log10(np.sqrt((x**2).mean(axis=1)) + 1e-9) > -30
            segs, start = [], None
            for i, on in enumerate(list(loud) + [False]):
                if on and start is None:
                    start = i
                elif not on and start is not None:
                    segs.append([round(float(t) + start * 0.25, 2), round(float(t) + i * 0.25, 2)])
                    start = None
            out.append({"asr.json": {"t": float(t), "segments": segs}})
        return out


def make_tiny(root: Path, videos: int = 3) -> Path:
    """Short "lectures": H.264 160x90 at 5 fps with a white caption on frames 5-9, and AAC audio
    that speaks (a 300 Hz tone) from 1 s to 3 s."""
    import io

    import av

    with gdsload.ShardWriter(root, shard_size="256KB") as w:
        for v in range(videos):
            buf = io.BytesIO()
            with av.open(buf, "w", format="mp4") as c:
                s = c.add_stream("libx264", rate=5)
                s.width, s.height, s.pix_fmt = 160, 90, "yuv420p"
                s.options = {"preset": "ultrafast", "tune": "zerolatency"}
                a = c.add_stream("aac", rate=16000)
                a.layout = "mono"
                for i in range(20 + 5 * v):
                    img = np.full((90, 160, 3), 40, np.uint8)
                    if 5 <= i < 10:
                        img[60:75, 20 + 10 * v : 120] = 255  # the caption
                    for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                        c.mux(p)
                for p in s.encode():
                    c.mux(p)
                n = 16000 * (4 + v)
                tt = np.arange(n) / 16000
                x = (0.3 * np.sin(2 * np.pi * 300 * tt) * ((tt >= 1) & (tt < 3))).astype(np.float32)
                for s0 in range(0, n, 1024):
                    fr = av.AudioFrame.from_ndarray(x[None, s0 : s0 + 1024].copy(), format="fltp", layout="mono")
                    fr.sample_rate, fr.pts = 16000, s0
                    for p in a.encode(fr):
                        c.mux(p)
                for p in a.encode():
                    c.mux(p)
            w.write({"__key__": f"lecture{v:03d}", "mp4": buf.getvalue()})
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="a dataset with video fields")
    ap.add_argument("--out", help="where the two output datasets go (default: a temporary folder)")
    ap.add_argument("--tiny", action="store_true", help="make a small dataset here first")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="gdsload-pass-"))
    shards = Path(a.shards) if a.shards else make_tiny(out / "lectures") if a.tiny else None
    if shards is None:
        ap.error("--shards or --tiny is needed")
    ocr = gdsload.process(shards, out / "ocr", StandInOCR, frames=(1.0, 8), size=None if a.tiny else 360,
                          workers=a.workers, resume=a.resume)
    asr = gdsload.process(shards, out / "asr", StandInASR, speech=2.0 if a.tiny else 30.0,
                          workers=a.workers, resume=a.resume)
    for name, r in (("ocr", ocr), ("asr", asr)):
        print(f"{name}: {r['media_hours'] * 3600:.1f} media s, {r['windows']} windows -> {r['outputs']} outputs, "
              f"stages {r['stages']}")
    captions = gdsload.open_dataset(out / "ocr")
    speech = gdsload.open_dataset(out / "asr")
    for s in captions.iter_samples():
        print(s["__key__"], "text:", json.loads(s["ocr.json"]))
    for s in speech.iter_samples():
        segs = json.loads(s["asr.json"])["segments"]
        if segs:
            print(s["__key__"], "speech:", segs)


if __name__ == "__main__":
    main()
