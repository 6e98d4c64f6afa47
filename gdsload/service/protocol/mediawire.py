"""VideoTransform / AudioTransform <-> MediaTransformSpec (BatchRequest.media, issue 30).

Every scalar of the specs is proto3 `optional`: what the client leaves at the Python default is
not sent, and an unset field is the Python default on the server, so both sides build equal
transforms. Kept apart from `wire.py` (image transforms, batches): media is its own block of the
protocol (field numbers from 1000).

Limits (issue 46): the server decodes within its own `MediaLimits` (`max_seconds` of a recording,
`max_pixels` and `max_frames` of a video; by default the transforms' defaults: 3600 s, 4K UHD,
100,000 frames). A request's limit that is unset or 0 (what a client's `None` is sent as) means the
server's limit, never "unlimited"; one at or below it is used; one above it is refused with
INVALID_ARGUMENT naming both: a client lowers the server's limits, never lifts them.

Memory: `decode_nbytes` is what a stream's audio decoding holds beyond its ring (the server's
budget counts it, `FeedServicer.stream_memory`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gdsload.decode import audio, video
from gdsload.decode.audio import AudioTransform
from gdsload.decode.video import VideoTransform
from gdsload.service.protocol.status import BadRequest
from gdsload.v1 import feed_pb2 as pb

_VIDEO_PAIRS = (("frames", "frames"), ("stride", "stride"), ("clips", "clips"), ("sampling", "sampling"),
                ("train", "train"), ("dtype", "dtype"), ("layout", "layout"), ("resize", "resize"),
                ("flip", "flip"))
_AUDIO = ("sample_rate", "seconds", "crop", "mono", "n_mels", "n_fft", "hop", "channels")


@dataclass(frozen=True)
class MediaLimits:
    """The largest media a server decodes; see the module docstring."""

    max_seconds: float = audio.MAX_SECONDS
    max_pixels: int = video.MAX_PIXELS
    max_frames: int = video.MAX_FRAMES


def _limit(name: str, sent: float, server: float) -> float:
    """A request's limit under the server's: 0 (or unset) is the server's; above it is refused."""
    if not sent:
        return server
    if sent < 0:
        raise BadRequest(f"{name}={sent!r} must be positive, or 0 (None) for the server's limit")
    if sent > server:
        show = lambda v: f"{v:.0f}" if float(v).is_integer() else repr(float(v))  # noqa: E731
        raise BadRequest(f"{name}={show(sent)} is over this server's limit of {show(server)}: send {show(server)} "
                         f"or less, or 0 (None) for the server's limit")
    return sent


def to_specs(media: Sequence[tuple[str | None, Any]]) -> list[pb.MediaTransformSpec]:
    """`LoaderOptions.media`-style pairs (field or None, transform) as request entries."""
    out = []
    for field, t in media:
        spec = pb.MediaTransformSpec(field=field or "")
        if isinstance(t, VideoTransform):
            v, d = spec.video, VideoTransform()
            v.SetInParent()  # set even when every field is the default (an empty message is unset)
            for attr, name in _VIDEO_PAIRS:
                if getattr(t, attr) != getattr(d, attr):
                    setattr(v, name, getattr(t, attr))
            if t.size != d.size:
                v.size = t.size or 0
            for attr in ("max_pixels", "max_frames"):
                if getattr(t, attr) != getattr(d, attr):
                    setattr(v, attr, getattr(t, attr) or 0)
            if (t.scale, t.ratio) != (d.scale, d.ratio):
                v.scale_min, v.scale_max = t.scale
                v.ratio_min, v.ratio_max = t.ratio
            if t.mean is None:
                v.no_normalize = True
            elif (t.mean, t.std) != (d.mean, d.std):
                v.mean.extend(t.mean)
                v.std.extend(t.std or ())
        elif isinstance(t, AudioTransform):
            a, d = spec.audio, AudioTransform()
            a.SetInParent()
            for name in _AUDIO:
                if getattr(t, name) != getattr(d, name):
                    setattr(a, name, getattr(t, name))
            if t.features:
                a.features = t.features
            if t.max_seconds != d.max_seconds:
                a.max_seconds = t.max_seconds or 0  # None (no limit here) is 0: the server's limit
        else:
            raise TypeError(f"not a VideoTransform or AudioTransform: {t!r}")
        out.append(spec)
    return out


def from_specs(specs: Sequence[pb.MediaTransformSpec], kinds: Mapping[str, str],
               limits: MediaLimits = MediaLimits()) -> dict[str, Any]:
    """Request entries as a `transform=` dict field -> transform, for the fields in `kinds`
    (field -> kind of the request's dataset), within the server's `limits`; BadRequest naming
    what is wrong."""
    out: dict[str, Any] = {}
    blanket = []
    for spec in specs:
        which = "video" if spec.HasField("video") else "audio" if spec.HasField("audio") else None
        if which is None or (spec.HasField("video") and spec.HasField("audio")):
            raise BadRequest(f"MediaTransformSpec for field {spec.field!r} needs exactly one of video, audio")
        try:
            t = _video(spec.video, limits) if which == "video" else _audio(spec.audio, limits)
        except BadRequest as exc:
            raise BadRequest(f"MediaTransformSpec for field {spec.field!r}: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"MediaTransformSpec for field {spec.field!r}: {exc}") from None
        if not spec.field:
            blanket.append((which, t))
            continue
        kind = kinds.get(spec.field)
        if kind != which:
            raise BadRequest(f"MediaTransformSpec field {spec.field!r} is {kind or 'not a field of the request'}, "
                             f"not {which}")
        out[spec.field] = t
    for which, t in blanket:
        for f, k in kinds.items():
            if k == which:
                out.setdefault(f, t)
    return out


def _video(v: pb.VideoTransformSpec, limits: MediaLimits) -> VideoTransform:
    kw: dict[str, Any] = {attr: getattr(v, name) for attr, name in _VIDEO_PAIRS if v.HasField(name)}
    if v.HasField("size"):
        kw["size"] = v.size or None
    for attr in ("max_pixels", "max_frames"):  # unset: the server's limit (the same as 0)
        kw[attr] = int(_limit(attr, getattr(v, attr), getattr(limits, attr)))
    if v.HasField("scale_min") or v.HasField("scale_max"):
        kw["scale"] = (v.scale_min, v.scale_max)
    if v.HasField("ratio_min") or v.HasField("ratio_max"):
        kw["ratio"] = (v.ratio_min, v.ratio_max)
    if v.no_normalize:
        kw["mean"] = kw["std"] = None
    elif len(v.mean):
        if len(v.mean) != 3 or len(v.std) not in (0, 3):
            raise ValueError("mean needs 3 values and std 3 or none")
        kw["mean"], kw["std"] = tuple(v.mean), tuple(v.std) or None
    return VideoTransform(**kw)


def _audio(a: pb.AudioTransformSpec, limits: MediaLimits) -> AudioTransform:
    kw: dict[str, Any] = {name: getattr(a, name) for name in _AUDIO if a.HasField(name)}
    if a.HasField("features"):
        kw["features"] = a.features or None
    kw["max_seconds"] = float(_limit("max_seconds", a.max_seconds, limits.max_seconds))  # unset: the server's
    return AudioTransform(**kw)


def decode_nbytes(media: Mapping[str, Any], batch_size: int) -> int:
    """Bytes a stream's media decoding holds beyond its ring, for a batch of `batch_size`:
    `gdsload.decode.audio.decode_nbytes` per audio field. Video decoding is not counted here."""
    return sum(audio.decode_nbytes(t, batch_size) for t in media.values() if t.kind == "audio")
