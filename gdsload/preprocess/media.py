"""A pass's media decoding: every window of one member, streamed, in order.

`RangeFile` gives PyAV a member of a shard as a file: it reads the shard by range (`read_extent`,
`READ_AHEAD` bytes at a time), never the whole member, and counts the seconds spent reading.
`frame_windows` and `speech_windows` decode one member from its start to its end with PyAV and
yield `Window`s as they fill, so memory is one window, the decoder's own buffers and one read
block, whatever the video's length.

Times count from the container's start: the earliest start of its video and audio streams
(exact, as fractions of each stream's time base), so a frame at t and speech at t line up.

Frames (`frame_windows(fps, window)`): sample k is at k/fps; its frame is the last frame shown at
or before k/fps (presentation timestamps, so a variable-frame-rate video is sampled by time and
frames may repeat; before the first frame, the first frame). Samples run while k/fps is before
the end of the last frame (its timestamp plus its duration, else plus 1/average rate). Window w
holds samples [w * window, (w + 1) * window); the last window is padded with zero frames and
t = -1. `t` is k/fps (the sampling time). `size` resizes the short side to `size` pixels (the
long side rounded to the nearest pixel) with FFmpeg's swscale, bilinear (`INTERPOLATION`), in the
same conversion to RGB24; every frame of a member is converted to the size its first frame gives.

Speech (`speech_windows(chunk_s)`): the first audio stream, downmixed to mono and resampled to
16 kHz float32 by FFmpeg's resampler (`av.AudioResampler`) in one sequential decode: a pass reads
every chunk, so the loader's windowed decode (`gdsload.decode.audio`: a seek per crop) would only
add seeks. The first decoded sample sits at its frame's timestamp (samples before it, from the
container's start, are zeros and count as valid); later samples follow contiguously. Chunk j
starts at j * chunk_s; `length` counts its valid samples (the last chunk's are fewer; zeros
after them).

Errors: `NoStream` when the member has no stream of the kind (counted, not an error); anything
FFmpeg refuses is a `ValueError` with its reason (the caller applies `on_error`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from gdsload.errors import require

READ_AHEAD = 1 << 20  # bytes read per range request
RATE = 16000  # speech sample rate (Hz)
INTERPOLATION = "BILINEAR"  # swscale's, for `size` (the bench's PyAV loop uses the same)


class NoStream(Exception):
    """The member has no stream of the kind the mode decodes."""


@dataclass
class Window:
    """One window of a member: `index`, and `frames` (window, H, W, 3) uint8 with `t`
    (window,) float64, or `audio` (samples,) float32 with `length` and `t` (a float)."""

    index: int
    data: np.ndarray
    t: Any
    length: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape


class RangeFile:
    """Bytes [offset, offset + size) of a shard as a read-only file object (PyAV's input).

    `read_extent(offset, nbytes) -> bytes` reads the shard by range: at least `READ_AHEAD` bytes
    a request (more when PyAV asks for more: its buffer is 32 KiB). The last `KEEP_BLOCKS` blocks
    are kept, so a demuxer that jumps to an MP4's index at the end and back reads nothing twice.
    `read_s` accumulates the seconds spent reading, `nbytes` the bytes read."""

    KEEP_BLOCKS = 4

    def __init__(self, read_extent: Callable[[int, int], bytes], offset: int, size: int):
        self._read = read_extent
        self._off, self._size = offset, size
        self._pos = 0
        self._blocks: list[tuple[int, bytes]] = []  # (start, bytes), newest last
        self.read_s = 0.0
        self.nbytes = 0

    def _block(self, pos: int, want: int) -> tuple[int, bytes]:
        for b in self._blocks:
            if b[0] <= pos < b[0] + len(b[1]):
                return b
        n = min(max(READ_AHEAD, want), self._size - pos)
        t0 = time.perf_counter()
        data = self._read(self._off + pos, n)
        self.read_s += time.perf_counter() - t0
        self.nbytes += len(data)
        self._blocks.append((pos, data))
        del self._blocks[: -self.KEEP_BLOCKS]
        return pos, data

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        out = []
        while self._pos < end:
            at, data = self._block(self._pos, end - self._pos)
            take = data[self._pos - at : end - at]
            out.append(take)
            self._pos += len(take)
        return b"".join(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = 0 if whence == 0 else self._pos if whence == 1 else self._size
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _av() -> Any:
    return require("av", extra="media", purpose="gdsload.process (PyAV decoding)")


def _origin(c: Any) -> Fraction:
    """The container's start: the earliest start of its video and audio streams (seconds)."""
    starts = [Fraction(s.start_time) * s.time_base for s in list(c.streams.video) + list(c.streams.audio)
              if s.start_time is not None and s.time_base]
    return min(starts) if starts else Fraction(0)


def _open(av: Any, f: RangeFile) -> Any:
    try:
        return av.open(f, "r")
    except av.FFmpegError as exc:
        raise ValueError(f"unreadable media: {exc}") from None


def out_size(width: int, height: int, size: int | None) -> tuple[int, int]:
    """(width, height) with the short side resized to `size` (None: as it is)."""
    if size is None:
        return width, height
    if width <= height:
        return size, max(1, round(height * size / width))
    return max(1, round(width * size / height)), size


def frame_windows(f: RangeFile, fps: float, window: int, size: int | None,
                  skip: int = 0) -> Iterator[Window]:
    """The member's frame windows (module docstring), from window `skip` on (earlier ones are
    decoded, not converted or yielded)."""
    av = _av()
    step = Fraction(fps).limit_denominator(1 << 20)
    with _open(av, f) as c:
        if not c.streams.video:
            raise NoStream("no video stream")
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        origin, tb = _origin(c), s.time_base
        rate = s.average_rate or s.guessed_rate
        default_dur = Fraction(1) / Fraction(rate) if rate else Fraction(0)
        k = 0
        wh: tuple[int, int] | None = None
        buf: list[np.ndarray] = []
        cache: tuple[Any, np.ndarray] | None = None  # the last frame converted (repeats reuse it)

        def convert(fr: Any) -> np.ndarray:
            nonlocal wh, cache
            if cache is not None and cache[0] is fr:
                return cache[1]
            if wh is None:
                wh = out_size(fr.width, fr.height, size)
            img = fr.reformat(width=wh[0], height=wh[1], format="rgb24", interpolation=INTERPOLATION).to_ndarray()
            cache = (fr, img)
            return img

        def emit(fr: Any) -> Iterator[Window]:
            nonlocal k
            w = k // window
            if w >= skip:
                buf.append(convert(fr))
                if len(buf) == window:
                    t = np.array([float(Fraction(i) / step) for i in range(w * window, (w + 1) * window)])
                    yield Window(w, np.stack(buf), t)
                    buf.clear()
            k += 1

        prev, end = None, Fraction(0)
        last_t = None
        try:
            for fr in c.decode(s):
                if fr.pts is not None:
                    tf = Fraction(fr.pts) * tb - origin
                elif last_t is not None:
                    tf = last_t + default_dur
                else:
                    tf = Fraction(0)
                shown = prev if prev is not None else fr  # before the first frame: the first
                while Fraction(k) / step < tf:
                    yield from emit(shown)
                prev, last_t = fr, tf
                dur = Fraction(fr.duration) * tb if getattr(fr, "duration", None) else default_dur
                end = max(end, tf + dur)
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt video after {k} frames sampled: {exc}") from None
        if prev is None:
            raise ValueError("no video frame decodes")
        while Fraction(k) / step < end:
            yield from emit(prev)
        if buf:
            w = (k - 1) // window
            n = len(buf)
            frames = np.zeros((window, *buf[0].shape), np.uint8)
            frames[:n] = np.stack(buf)
            t = np.full(window, -1.0)
            t[:n] = [float(Fraction(i) / step) for i in range(w * window, w * window + n)]
            yield Window(w, frames, t)


def speech_windows(f: RangeFile, chunk_s: float, skip: int = 0) -> Iterator[Window]:
    """The member's speech chunks (module docstring), from chunk `skip` on."""
    av = _av()
    chunk = round(chunk_s * RATE)
    with _open(av, f) as c:
        if not c.streams.audio:
            raise NoStream("no audio stream")
        s = c.streams.audio[0]
        origin, tb = _origin(c), s.time_base
        rs = av.AudioResampler(format="flt", layout="mono", rate=RATE)
        buf = np.zeros(chunk, np.float32)
        pos: int | None = None  # samples at 16 kHz from the container's start placed so far
        j = 0  # the chunk being filled

        def put(x: np.ndarray) -> Iterator[Window]:
            nonlocal pos, j
            i = 0
            while i < len(x):
                at = pos - j * chunk  # where in chunk j
                n = min(chunk - at, len(x) - i)
                if j >= skip:
                    buf[at : at + n] = x[i : i + n]
                i += n
                pos += n
                if pos == (j + 1) * chunk:
                    if j >= skip:
                        yield Window(j, buf.copy(), float(j * chunk) / RATE, chunk)
                    j += 1

        try:
            for fr in c.decode(s):
                if pos is None:
                    t0 = Fraction(fr.pts) * tb - origin if fr.pts is not None and tb else Fraction(0)
                    pos = max(0, round(t0 * RATE))
                    j = pos // chunk
                    for z in range(0, j):  # whole chunks before the audio starts: silence
                        if z >= skip:
                            yield Window(z, np.zeros(chunk, np.float32), float(z * chunk) / RATE, chunk)
                    buf[:] = 0
                for g in rs.resample(fr):
                    yield from put(g.to_ndarray().reshape(-1))
            if pos is None:
                raise ValueError("no audio frame decodes")
            for g in rs.resample(None):
                yield from put(g.to_ndarray().reshape(-1))
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt audio in chunk {j}: {exc}") from None
        n = pos - j * chunk
        if n > 0 and j >= skip:
            buf[n:] = 0
            yield Window(j, buf.copy(), float(j * chunk) / RATE, n)
