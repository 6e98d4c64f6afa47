"""A pass's memory is bounded by its batch and a decode buffer, not by a video's length: the
reader thread is ahead of the batch by at most `AHEAD_BYTES` of windows (and does get ahead, so
the bound is what stops it), and a long video's pass (a NumPy no-op fn, each in a fresh process)
peaks within 1.2x of a 1-minute one's (issue 54's target, on small video as CI can afford)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mediakit as mk

import gdsload
from gdsload.preprocess import unit as punit


def test_the_reader_is_ahead_by_at_most_AHEAD_BYTES(media_src: Path, tmp_path: Path, monkeypatch) -> None:
    window = 4 * 45 * 80 * 3  # a window's bytes: 4 frames of 45x80 RGB
    monkeypatch.setattr(punit, "AHEAD_BYTES", int(2.5 * window))
    seen: list[int] = []
    real = punit._Reader.taken

    def spy(self, ev):
        seen.append(self._ahead)
        return real(self, ev)

    monkeypatch.setattr(punit._Reader, "taken", spy)

    def slow(b):
        time.sleep(0.02)  # fn slower than decoding: the reader runs ahead until the bound stops it
        return [None] * len(b["window"])

    r = gdsload.process(media_src, tmp_path / "o", slow, frames=(5.0, 4), size=45, batch_size=2)
    assert r["windows"] > 10
    assert max(seen) <= 2.5 * window and max(seen) >= 2 * window


def _peak_mb(src: Path, out: Path) -> float:
    code = ("import gdsload, json, sys\n"
            "gdsload.process(sys.argv[1], sys.argv[2], lambda b: [None] * len(b['window']), frames=(1.0, 8),"
            " batch_size=16)\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
            "print(json.dumps(int(hwm) / 1024))\n")
    p = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                       timeout=120, check=True)
    return float(p.stdout.strip().splitlines()[-1])


def test_a_long_videos_peak_memory_is_that_of_a_short_one(tmp_path: Path) -> None:
    peaks = {}
    for name, seconds in (("short", 60.0), ("long", 600.0)):
        src = tmp_path / name
        with gdsload.ShardWriter(src) as w:
            w.write({"__key__": name, "mp4": mk.video(seconds, fps=5, audio=False)})
        peaks[name] = _peak_mb(src, tmp_path / f"out-{name}")
    assert peaks["long"] <= 1.2 * peaks["short"], peaks


def _python_peak(src: Path, out: Path, mode: str) -> int:
    kw = "frames=(1.0, 2)" if mode == "frames" else "speech=2.0"
    code = ("import gdsload, json, sys, tracemalloc\n"
            "from gdsload.decode import passmedia\n"
            "passmedia.READ_AHEAD = 32 << 10\n"  # read blocks smaller than a member: both keep KEEP_BLOCKS
            "tracemalloc.start()\n"
            f"gdsload.process(sys.argv[1], sys.argv[2], lambda b: [None] * len(b['window']), {kw}, batch_size=2)\n"
            "print(json.dumps(tracemalloc.get_traced_memory()[1]))\n")
    p = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                       timeout=120, check=True)
    return int(p.stdout.strip().splitlines()[-1])


def test_what_the_pass_allocates_does_not_grow_with_length(tmp_path: Path) -> None:
    """Every allocation of Python code (gdsload's, PyAV's objects, NumPy's arrays: tracemalloc)
    peaks at the same bytes for a 30-second and an 8x longer video, both filling whole batches:
    nothing is kept per frame, packet, window or member (timestamps, packets, windows, events);
    the read blocks are bounded (`RangeFile.KEEP_BLOCKS` of `READ_AHEAD`, made smaller than these
    members here, as a long video's are)
    What does grow with length is below Python: FFmpeg's MP4 demuxer indexes every sample of every
    track when it opens the file (docs/preprocessing.md, "Memory")."""
    peaks: dict[str, list[int]] = {"frames": [], "speech": []}
    for name, seconds in (("short", 30.0), ("long", 240.0)):
        src = tmp_path / name
        with gdsload.ShardWriter(src) as w:
            w.write({"__key__": name, "mp4": mk.video(seconds, fps=5, audio=True)})
        for mode in peaks:
            peaks[mode].append(_python_peak(src, tmp_path / f"out-{name}-{mode}", mode))
    for mode, (short, long) in peaks.items():
        assert long - short <= 16 << 10, (mode, short, long)
