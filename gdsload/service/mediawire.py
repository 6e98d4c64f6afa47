"""VideoTransform / AudioTransform <-> MediaTransformSpec (BatchRequest.media, issue 30).

Every scalar of the specs is proto3 `optional`: what the client leaves at the Python default is
not sent, and an unset field is the Python default on the server, so both sides build equal
transforms. Kept apart from `wire.py` (image transforms, batches): media is its own block of the
protocol (field numbers from 1000).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gdsload.decode.audio import AudioTransform
from gdsload.decode.video import VideoTransform
from gdsload.service.protocol.status import BadRequest
from gdsload.v1 import feed_pb2 as pb

_VIDEO_PAIRS = (("frames", "frames"), ("stride", "stride"), ("clips", "clips"), ("sampling", "sampling"),
                ("train", "train"), ("dtype", "dtype"), ("layout", "layout"), ("resize", "resize"),
                ("flip", "flip"))
_AUDIO = ("sample_rate", "seconds", "crop", "mono", "n_mels", "n_fft", "hop", "channels")


def to_specs(media: Sequence[tuple[str | None, Any]]) -> list[pb.MediaTransformSpec]:
    """`LoaderOptions.media`-style pairs (field or None, transform) as request entries."""
    out = []
    for field, t in media:
        spec = pb.MediaTransformSpec(field=field or "")
        if isinstance(t, VideoTransform):
            v, d = spec.video, VideoTransform()
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
            for name in _AUDIO:
                if getattr(t, name) != getattr(d, name):
                    setattr(a, name, getattr(t, name))
            if t.features:
                a.features = t.features
            if t.max_seconds != d.max_seconds:
                a.max_seconds = t.max_seconds or 0
        else:
            raise TypeError(f"not a VideoTransform or AudioTransform: {t!r}")
        out.append(spec)
    return out


def from_specs(specs: Sequence[pb.MediaTransformSpec], kinds: Mapping[str, str]) -> dict[str, Any]:
    """Request entries as a `transform=` dict field -> transform, for the fields in `kinds`
    (field -> kind of the request's dataset); BadRequest naming what is wrong."""
    out: dict[str, Any] = {}
    blanket = []
    for spec in specs:
        which = "video" if spec.HasField("video") else "audio" if spec.HasField("audio") else None
        if which is None or (spec.HasField("video") and spec.HasField("audio")):
            raise BadRequest(f"MediaTransformSpec for field {spec.field!r} needs exactly one of video, audio")
        try:
            t = _video(spec.video) if which == "video" else _audio(spec.audio)
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


def _video(v: pb.VideoTransformSpec) -> VideoTransform:
    kw: dict[str, Any] = {attr: getattr(v, name) for attr, name in _VIDEO_PAIRS if v.HasField(name)}
    if v.HasField("size"):
        kw["size"] = v.size or None
    for attr in ("max_pixels", "max_frames"):
        if v.HasField(attr):
            kw[attr] = getattr(v, attr) or None
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


def _audio(a: pb.AudioTransformSpec) -> AudioTransform:
    kw: dict[str, Any] = {name: getattr(a, name) for name in _AUDIO if a.HasField(name)}
    if a.HasField("features"):
        kw["features"] = a.features or None
    if a.HasField("max_seconds"):
        kw["max_seconds"] = a.max_seconds or None
    return AudioTransform(**kw)
