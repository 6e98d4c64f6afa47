"""Video and audio members: probing at conversion, and the pure sampling math of the loader.

`probe(data, ext)` opens one member with PyAV (`av`, the `media` extra) and returns what the
loader plans from without opening the file again: for video `codec`, `pix_fmt`, `width`, `height`,
`fps`, `frames` (video packets counted by demuxing: no decode), `duration` (s), `keyint` (the
largest gap between key frames, in frames), `bits` (8 or 10), `full_range` (1 for JPEG-range
video; rotation metadata is not read, and decoded frames are not rotated); for
audio `codec`, `sample_rate`, `channels`, `samples` and `duration`. It raises `ValueError` with
the reason for media the loader cannot decode: no stream of the kind, an undecodable codec, or
chroma that NVDEC refuses (H.264/HEVC other than 4:2:0). `validate(data, ext)` decodes every
frame (`gdsload convert --validate`).

The loader's randomness (clip positions, crops, flips, audio crops) is `draws(seed, epoch, ids,
salt)`: a hash of the plan's seed, the epoch and the sample's global id, so a resumed run (or a
run on another world size) samples the same clips. `clip_indices` and `crop_roi` turn draws into
frame indices (-1 for padding) and crop windows.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import numpy as np

#: codecs DALI's CPU video decoder handles (its bundled FFmpeg has no H.264/HEVC decoder; checked
#: on the 2.4 CPU wheel); the rest go through PyAV on a CPU host
DALI_CPU_VIDEO = frozenset({"vp8", "vp9", "mjpeg"})
#: codecs NVDEC decodes (DALI `device="mixed"`); demuxed on the host, as every decoder does
NVDEC_VIDEO = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
#: codecs DALI's audio decoder (libsndfile) handles; MP3/AAC go through PyAV
DALI_AUDIO = frozenset({"flac", "vorbis", "opus"}) | {f"pcm_{f}" for f in (
    "s16le", "s24le", "s32le", "f32le", "f64le", "u8")}
_NVDEC_420 = frozenset({"h264", "hevc"})


def _av() -> Any:
    from gdsload.errors import require

    require("av", extra="media", purpose="video and audio (probing and PyAV decoding)")
    import av

    return av


def rgb24_scaler() -> Callable[..., np.ndarray]:
    """A converter of decoded PyAV video frames to (H, W, 3) uint8 RGB (keywords: `width`,
    `height`, `interpolation`, as `VideoReformatter.reformat` takes them), with its own scaler
    context, run on the calling thread. Make one per video (a context per frame costs as much
    again as the scaling).

    Why not `frame.to_ndarray(format="rgb24")`: since PyAV 17 that scales with a pool of FFmpeg
    slice threads by default, and PyAV 18 keeps that scaler per Python thread (PyAV #2379). A
    process forked from a thread that has scaled so (a PyTorch DataLoader's workers, a
    `multiprocessing` pool, gdsload's own pass and convert workers: fork is the default on Linux)
    inherits the scaler without its threads and hangs for good the next time it scales on that
    thread, whatever `threads` it asks for then: FFmpeg joins the old slice threads, which are
    not there. Seen in this project's CI with PyAV 18.1 (a child stuck in
    `avpriv_slicethread_free` under `sws_frame_setup`); test:
    `tests/test_media.py::test_a_process_forked_after_a_video_scale_decodes_too`. A context of
    our own is never the shared one, and one thread (`threads=1`, PyAV >= 17) starts no pool per
    video: the loader runs samples in parallel instead."""
    one = _one_thread()  # (imports PyAV, or names the extra that installs it)
    from av.video.reformatter import VideoReformatter

    sws = VideoReformatter()

    def rgb24(frame: Any, **kw: Any) -> np.ndarray:
        return sws.reformat(frame, format="rgb24", **kw, **one).to_ndarray()

    return rgb24


@functools.cache
def _one_thread() -> dict[str, int]:
    return {"threads": 1} if int(_av().__version__.split(".")[0]) >= 17 else {}  # no `threads` before 17


def _open(av: Any, data: bytes | memoryview) -> Any:
    try:
        return av.open(io.BytesIO(bytes(data)), "r")
    except av.FFmpegError as exc:
        raise ValueError(f"unreadable media: {exc}") from None


def probe(data: bytes | memoryview, kind: str) -> dict[str, Any]:
    """The metadata of one `kind` ("video" or "audio") member; ValueError with the reason if the
    loader could not decode it."""
    av = _av()
    with _open(av, data) as c:
        try:
            return _probe_video(c) if kind == "video" else _probe_audio(c)
        except av.FFmpegError as exc:
            raise ValueError(f"unreadable media: {exc}") from None


def _probe_video(c: Any) -> dict[str, Any]:
    if not c.streams.video:
        raise ValueError("no video stream")
    s = c.streams.video[0]
    cc = s.codec_context
    name = cc.name
    pix = cc.pix_fmt or ""
    if not cc.width or not cc.height:
        raise ValueError(f"video stream has no frame size ({name})")
    if name in _NVDEC_420 and "420" not in pix and pix not in ("nv12", "p010le"):
        raise ValueError(f"{name} with pixel format {pix}: NVDEC decodes 4:2:0 {name} only")
    frames = 0
    keys: list[int] = []
    for pkt in c.demux(s):
        if pkt.size == 0:
            continue
        if pkt.is_keyframe:
            keys.append(frames)
        frames += 1
    if frames == 0:
        raise ValueError(f"video stream has no frames ({name})")
    gaps = np.diff(keys + [frames]) if keys else np.array([frames])
    fps = float(s.average_rate) if s.average_rate else 0.0
    duration = float(s.duration * s.time_base) if s.duration and s.time_base else (frames / fps if fps else 0.0)
    return {"kind": "video", "codec": name, "pix_fmt": pix, "width": int(cc.width), "height": int(cc.height),
            "fps": fps, "frames": frames, "duration": duration, "keyint": int(gaps.max()),
            "bits": 10 if "10" in pix else 8, "full_range": int(pix.startswith("yuvj"))}


def _probe_audio(c: Any) -> dict[str, Any]:
    if not c.streams.audio:
        raise ValueError("no audio stream")
    s = c.streams.audio[0]
    cc = s.codec_context
    if not cc.sample_rate:
        raise ValueError(f"audio stream has no sample rate ({cc.name})")
    ticks = 0
    for pkt in c.demux(s):
        if pkt.duration:
            ticks += pkt.duration
    tb = s.time_base
    seconds = float(ticks * tb) if ticks and tb else float(c.duration or 0) / 1e6
    return {"kind": "audio", "codec": cc.name, "sample_rate": int(cc.sample_rate), "channels": int(cc.channels),
            "samples": round(seconds * cc.sample_rate), "duration": seconds}


def validate(data: bytes | memoryview, kind: str) -> None:
    """Decode every frame of a member with PyAV; ValueError naming what failed."""
    av = _av()
    with _open(av, data) as c:
        streams = c.streams.video if kind == "video" else c.streams.audio
        if not streams:
            raise ValueError(f"no {kind} stream")
        n = 0
        try:
            for _ in c.decode(streams[0]):
                n += 1
        except av.FFmpegError as exc:
            raise ValueError(f"corrupt {kind} after {n} frames: {exc}") from None
        if n == 0:
            raise ValueError(f"no {kind} frame decodes")


# -- the loader's sampling math (pure) ----------------------------------------------------------
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def draws(seed: int, epoch: int, ids: np.ndarray, salt: int, k: int = 1) -> np.ndarray:
    """(len(ids), k) floats in [0, 1), a pure function of (seed, epoch, global sample id, salt):
    the same sample in the same epoch draws the same values on any rank, thread or resume."""
    ids = np.asarray(ids, np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(epoch) + np.uint64(salt) * np.uint64(1 << 40))
        x = _mix(h ^ (ids * np.uint64(0xD1B54A32D192ED03) + np.arange(k, dtype=np.uint64)[None, :]))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def clip_indices(n_frames: int, frames: int, stride: int, clips: int, sampling: str, u: float) -> np.ndarray:
    """(clips, frames) source frame indices in presentation order, -1 where the video is too short.

    A clip spans `(frames - 1) * stride + 1` frames. One clip: "random" starts at a uniform draw
    (`u`) of the possible starts, "uniform" at 0, "center" in the middle. Several clips: "uniform"
    and "center" spread the starts evenly from the first to the last possible start; "random"
    spreads them over `clips` equal parts and shifts all by one draw within a part. A video
    shorter than a clip starts at 0 and pads the tail with -1."""
    span = (frames - 1) * stride + 1
    room = max(0, n_frames - span)  # last possible start
    if clips == 1:
        start = {"random": int(u * (room + 1)), "uniform": 0, "center": room // 2}[sampling]
        starts = np.array([min(start, room)], np.int64)
    else:
        step = room / (clips - 1) if sampling != "random" else room / clips
        starts = np.floor(np.arange(clips) * step).astype(np.int64)
        if sampling == "random":
            starts = starts + int(u * (step + 1)) if step else starts
        starts = np.minimum(starts, room)
    idx = starts[:, None] + np.arange(frames, dtype=np.int64)[None, :] * stride
    idx[idx >= n_frames] = -1
    return idx


def crop_roi(height: int, width: int, train: bool, scale: tuple[float, float], ratio: tuple[float, float],
             size: int, resize: int, u: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
    """The crop window ((y0, x0), (y1, x1)), relative to the frame, of one clip. train: random
    resized crop (area fraction in `scale`, aspect in `ratio`, as `ImageTransform`; `u`: 4 draws),
    the whole frame when 10 tries fail; eval: the centre square of `size / resize` of the short
    side (resize the short side to `resize`, centre crop `size`)."""
    if train:
        area = height * width
        for t in range(10):
            a = area * (scale[0] + (scale[1] - scale[0]) * ((u[0] + 0.618 * t) % 1.0))
            lr = np.log(ratio[0]) + (np.log(ratio[1]) - np.log(ratio[0])) * ((u[1] + 0.382 * t) % 1.0)
            r = float(np.exp(lr))
            w, h = np.sqrt(a * r), np.sqrt(a / r)
            if w <= width and h <= height:
                y0 = (height - h) * u[2]
                x0 = (width - w) * u[3]
                return (y0 / height, x0 / width), ((y0 + h) / height, (x0 + w) / width)
        return (0.0, 0.0), (1.0, 1.0)
    side = min(height, width) * min(1.0, size / resize)
    y0, x0 = (height - side) / 2, (width - side) / 2
    return (y0 / height, x0 / width), ((y0 + side) / height, (x0 + side) / width)
