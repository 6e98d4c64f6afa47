"""A preprocessing pass's media decoding (`gdsload.process`): every window of one member, streamed,
in order. Here, below both the pass (`gdsload.preprocess`) and the feed's server
(`gdsload.service.server.windows`), so a pass decoded here and one decoded on a feed server run
the same code and give the same windows.

`RangeFile` gives PyAV a member of a shard as a file: it reads the shard by range (`read_extent`,
`READ_AHEAD` bytes at a time), never the whole member, and counts the seconds spent reading.
`frame_windows` and `speech_windows` decode one member from its start to its end with PyAV and
yield `Window`s as they fill, so memory is one window, the decoder's own buffers, one read
block and (frames) one group of pictures' encoded packets (at most `GOP_LIMIT_BYTES`), whatever
the video's length; only FFmpeg's own sample index grows with it (an MP4's, of every track, built
when it opens: tens of bytes a sample; docs/preprocessing.md, Memory). The demuxer skips the
streams a mode does not decode (in an MP4 their bytes are not read).

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
Less work than decoding every frame, with the same windows: only picked frames are converted
(once, however often they repeat), and for H.264 in MP4/MOV/Matroska only the frames a sample
picks and those they are predicted from are decoded (`_frames`: at 1 fps from 30 fps, B-frames
between picks and each group's frames after its last pick are left out).

Speech (`speech_windows(chunk_s)`): the first audio stream, downmixed to mono and resampled to
16 kHz float32 by FFmpeg's resampler (`av.AudioResampler`, in frames of `RESAMPLED` samples: the
same samples as frame by frame, in fewer calls) in one sequential decode: a pass reads
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
RESAMPLED = 1 << 16  # samples per resampled frame (the resampler's FIFO: fewer, larger frames)
INTERPOLATION = "BILINEAR"  # swscale's, for `size` (the bench's PyAV loop uses the same)


class NoStream(Exception):
    """The member has no stream of the kind the mode decodes."""


@dataclass
class Window:
    """One window of a member: `index`, and `frames` (window, H, W, 3) uint8 with `t`
    (window,) float64, or `audio` (samples,) float32 with `length` and `t` (a float)."""

    index: int
    data: np.ndarray | None  # None once the consumer has copied it into its batch
    t: Any
    length: int = 0
    shape: tuple[int, ...] = ()
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.shape, self.nbytes = self.data.shape, self.data.nbytes


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


def _threads(s: Any, threads: int | None) -> None:
    """Decoder threads: None, FFmpeg's choice (frame and slice threads, as many as cores); n, at
    most n (1: none; a pass in `workers` processes gives each cores // workers)."""
    cc = s.codec_context
    if threads is None:
        s.thread_type = "AUTO"
    elif threads <= 1:
        cc.thread_type, cc.thread_count = "NONE", 1
    else:
        cc.thread_type, cc.thread_count = "AUTO", threads


def _discard_others(av: Any, c: Any, keep: Any) -> None:
    """The demuxer skips every other stream's packets (an MP4's are not even read)."""
    for st in c.streams:
        if st.index != keep.index:
            st.discard = av.stream.Discard.all


def _avcc_nal_size(s: Any) -> int:
    """Bytes of the NAL length prefix of H.264 in AVCC form (MP4, MOV, Matroska), else 0."""
    cc = s.codec_context
    try:
        ext = bytes(cc.extradata or b"")
    except (TypeError, ValueError):
        return 0
    if cc.name != "h264" or len(ext) < 7 or ext[0] != 1:
        return 0
    return (ext[4] & 3) + 1


def _nal_kind(p: Any, nsize: int) -> tuple[bool, bool]:
    """(IDR, non-reference) of an H.264 AVCC packet, from its first slice's NAL header
    (nal_unit_type 5: IDR; nal_ref_idc 0: no picture refers to this one, H.264 7.4.1). Unknown
    (no slice, a truncated length): (False, False), the safe answer (keep it, no cut before it)."""
    mv = memoryview(p)
    n, pos = len(mv), 0
    while pos + nsize < n:
        length = int.from_bytes(mv[pos : pos + nsize], "big")
        hdr = mv[pos + nsize]
        kind = hdr & 31
        if kind in (1, 5):
            return kind == 5, (hdr >> 5) & 3 == 0
        if length <= 0:
            break
        pos += nsize + length
    return False, False


class _Picker:
    """Which presentation times get a sample: integer arithmetic on timestamps (no Fraction per
    frame). A frame shown over [pts, next_pts) (stream time base) is picked when a sample
    time k/fps falls in it."""

    def __init__(self, step: Fraction, tb: Fraction, origin: Fraction):
        a, b = step * tb, step * origin  # sample index at pts: pts * a - b
        self.an, self.ad, self.bn, self.bd = a.numerator, a.denominator, b.numerator, b.denominator

    def first_sample(self, pts: int) -> int:
        """The smallest k >= 0 with k/fps at or after pts."""
        num = pts * self.an * self.bd - self.bn * self.ad
        return max(0, -((-num) // (self.ad * self.bd)))

    def before(self, k: int, pts: int) -> bool:
        """k/fps < pts (as times from the container's start)."""
        return k * self.ad * self.bd < pts * self.an * self.bd - self.bn * self.ad


GOP_LIMIT_PACKETS = 1024  # a longer group of pictures is decoded whole (bounded look-ahead)
GOP_LIMIT_BYTES = 32 << 20


def _plan_gop(gop: list[tuple[Any, int, bool]], next_pts: int, picker: _Picker, first: bool) -> list[Any]:
    """The packets of one closed group (an IDR and what follows it up to the next IDR, in
    decode order: (packet, pts, non-reference)) that are decoded: the frames picked, and every
    reference frame decoded before the last one picked. `next_pts`: the next group's IDR, the
    first frame shown after this group's. `first`: the video's first group (its first frame
    is shown before the first frame too)."""
    order = sorted(range(len(gop)), key=lambda i: gop[i][1])
    picked = [False] * len(gop)
    for j, i in enumerate(order):
        succ = gop[order[j + 1]][1] if j + 1 < len(order) else next_pts
        picked[i] = (first and j == 0) or picker.before(picker.first_sample(gop[i][1]), succ)
    last = max((i for i in range(len(gop)) if picked[i]), default=-1)
    return [p for i, (p, _, nonref) in enumerate(gop) if picked[i] or (i < last and not nonref)]


def _frames(av: Any, c: Any, s: Any, picker: _Picker | None, stats: dict[str, int],
            planned: set[int]) -> Iterator[Any]:
    """The video's decoded frames in output order. With a `picker` (H.264 in AVCC form) only the
    frames a sample can pick and those they are predicted from are decoded (`_plan_gop`): each
    group (an IDR up to the next) is planned once the next IDR is demuxed. Decoded whole: what
    comes before the first IDR, the last group (its last frame ends the video), a group over
    the look-ahead limits (`GOP_LIMIT_*`), one with a packet without a timestamp, repeated
    timestamps, or a timestamp at or after the next IDR's. Exact: a frame left out is shown at
    no sampling time and no decoded frame refers to it (a non-reference frame, or one after the
    last picked frame before an IDR, which no later frame can refer past); this assumes that
    timestamps rise in the decoder's output order, as every H.264 muxer writes them: `planned`
    gets the timestamps of the frames decoded from groups with frames left out, and the caller
    checks that each of those comes after the frame before it. tests/process/test_decode_plan.py
    compares with decoding every frame."""
    cc = s.codec_context
    if picker is None:
        yield from c.decode(s)
        return
    nsize = _avcc_nal_size(s)
    gop: list[tuple[Any, int, bool]] = []
    gop_bytes = 0
    planning = False  # the packets of the current group are held for a plan
    sent = False  # a packet was given to the decoder

    def send(packets: list[Any]) -> Iterator[Any]:
        nonlocal sent
        for q in packets:
            sent = True
            yield from cc.decode(q)

    for p in c.demux(s):
        if p.size == 0:
            continue
        idr, nonref = _nal_kind(p, nsize)
        if idr:
            held = [g[0] for g in gop]
            if planning and gop and p.pts is not None:
                pts = [g[1] for g in gop]
                if len(set(pts)) == len(pts) and max(pts) < p.pts:
                    held = _plan_gop(gop, p.pts, picker, first=not sent)
                    stats["dropped"] += len(gop) - len(held)
                    kept = {id(q) for q in held}
                    stats["dropped_nonref"] += sum(1 for g in gop if g[2] and id(g[0]) not in kept)
                    if len(held) < len(gop):
                        planned.update(q.pts for q in held)
            yield from send(held)
            gop, gop_bytes = [], 0
            planning = p.pts is not None
            stats["groups"] += 1
        if planning and p.pts is None:
            planning = False
            yield from send([g[0] for g in gop])
            gop = []
        if not planning:
            yield from send([p])
            continue
        gop.append((p, p.pts, nonref))
        gop_bytes += p.size
        if len(gop) > GOP_LIMIT_PACKETS or gop_bytes > GOP_LIMIT_BYTES:
            planning = False
            yield from send([g[0] for g in gop])
            gop = []
    yield from send([g[0] for g in gop])
    yield from cc.decode(None)


def frame_windows(f: RangeFile, fps: float, window: int, size: int | None,
                  skip: int = 0, threads: int | None = None, plan: bool = True,
                  stats: dict[str, int] | None = None) -> Iterator[Window]:
    """The member's frame windows (module docstring), from window `skip` on (earlier ones are
    decoded, not converted or yielded). `threads`: decoder threads (`_threads`). `plan`: decode
    only the frames that are picked and those they need (H.264 in MP4/MOV/Matroska; `_frames`);
    False decodes every frame (the same windows; the tests' reference). `stats`, if given,
    counts IDR `groups`, frames `dropped` (not decoded) and of those `dropped_nonref` (non-reference
    frames)."""
    av = _av()
    from av.video.reformatter import VideoReformatter

    step = Fraction(fps).limit_denominator(1 << 20)
    stats = stats if stats is not None else {}
    stats.update(groups=0, dropped=0, dropped_nonref=0)
    with _open(av, f) as c:
        if not c.streams.video:
            raise NoStream("no video stream")
        s = c.streams.video[0]
        _threads(s, threads)
        _discard_others(av, c, s)
        origin, tb = _origin(c), s.time_base
        rate = s.average_rate or s.guessed_rate
        default_dur = Fraction(1) / Fraction(rate) if rate else Fraction(0)
        picker = _Picker(step, tb, origin) if tb else None
        k = 0
        wh: tuple[int, int] | None = None
        out: np.ndarray | None = None  # the window being filled
        n = 0  # frames in it
        cache: tuple[Any, np.ndarray] | None = None  # the last frame converted (repeats reuse it)
        sws = VideoReformatter()  # one scaler context for the member (a fresh one per frame costs as much again)

        def convert(fr: Any) -> np.ndarray:
            nonlocal wh, cache
            if cache is not None and cache[0] is fr:
                return cache[1]
            if wh is None:
                wh = out_size(fr.width, fr.height, size)
            img = sws.reformat(fr, width=wh[0], height=wh[1], format="rgb24", interpolation=INTERPOLATION).to_ndarray()
            cache = (fr, img)
            return img

        def times(w: int, m: int) -> np.ndarray:
            t = np.full(window, -1.0)
            t[:m] = [float(Fraction(i) / step) for i in range(w * window, w * window + m)]
            return t

        def emit(fr: Any) -> Iterator[Window]:
            nonlocal k, out, n
            w = k // window
            if w >= skip:
                img = convert(fr)
                if out is None or out.shape[1:] != img.shape:
                    if n:  # a frame size change inside a window: as np.stack would refuse
                        raise ValueError(f"frame size changes inside window {w} ({out.shape[1:]} to {img.shape})")
                    out = np.empty((window, *img.shape), np.uint8)
                out[n] = img
                n += 1
                if n == window:
                    yield Window(w, out, times(w, window))
                    out, n = None, 0
            k += 1

        prev = None
        end_pts: Any = None  # the end of the last frame (pts units; a Fraction where a duration is guessed)
        last_pts: Any = None
        dur_pts = default_dur / tb if tb else Fraction(0)
        use_plan = plan and picker is not None and _avcc_nal_size(s) > 0
        planned: set[int] = set()  # timestamps of frames to come from groups with frames left out
        try:
            for fr in _frames(av, c, s, picker if use_plan else None, stats, planned):
                pts = fr.pts
                if pts is None:  # no timestamp: one (guessed) frame duration after the last
                    pts = last_pts + dur_pts if last_pts is not None else origin / tb
                shown = prev if prev is not None else fr  # before the first frame: the first
                if pts in planned:
                    planned.discard(pts)
                    if last_pts is not None and pts <= last_pts:
                        raise ValueError(
                            f"frame timestamps go back ({pts} after {last_pts}, time base {tb}): frames were left "
                            f"out of the decode by their timestamps, which this file breaks")
                if picker is not None and isinstance(pts, int):
                    while picker.before(k, pts):
                        yield from emit(shown)
                else:
                    while Fraction(k) / step < pts * tb - origin:
                        yield from emit(shown)
                prev, last_pts = fr, pts
                d = fr.duration if getattr(fr, "duration", None) else dur_pts
                e = pts + d
                if end_pts is None or e > end_pts:
                    end_pts = e
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt video after {k} frames sampled: {exc}") from None
        if prev is None:
            raise ValueError("no video frame decodes")
        end = max(Fraction(0), end_pts * tb - origin)
        while Fraction(k) / step < end:
            yield from emit(prev)
        if n:
            w = (k - 1) // window
            out[n:] = 0
            yield Window(w, out, times(w, n))


def speech_windows(f: RangeFile, chunk_s: float, skip: int = 0) -> Iterator[Window]:
    """The member's speech chunks (module docstring), from chunk `skip` on."""
    av = _av()
    chunk = round(chunk_s * RATE)
    with _open(av, f) as c:
        if not c.streams.audio:
            raise NoStream("no audio stream")
        s = c.streams.audio[0]
        _discard_others(av, c, s)
        origin, tb = _origin(c), s.time_base
        rs = av.AudioResampler(format="flt", layout="mono", rate=RATE, frame_size=RESAMPLED)
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
