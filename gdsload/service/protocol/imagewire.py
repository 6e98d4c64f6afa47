"""An `ImageTransform` on the wire (`BatchRequest.transform`, an `ImageTransformSpec` documented in
proto/gdsload/v1/feed.proto): the client's `transform_to_spec`, the server's `spec_to_transform`
(checked against the server's largest image side), and `spec_defaults`, the proto's defaults."""

from __future__ import annotations

from collections.abc import Sequence

from gdsload.decode.image import ImageTransform
from gdsload.service.protocol.status import BadRequest, OverLimit
from gdsload.v1 import feed_pb2 as pb


def transform_to_spec(t: ImageTransform) -> pb.ImageTransformSpec:
    """The wire form of an ImageTransform (doubles: the values arrive exactly)."""
    if t.user_fn is not None:
        raise BadRequest(
            "an ImageTransform with a user_fn cannot be sent to the server (code does not travel); "
            "decode remotely without it and apply the function to the batches on the trainer"
        )
    return pb.ImageTransformSpec(
        size=t.size, train=t.train, scale_min=t.scale[0], scale_max=t.scale[1],
        ratio_min=t.ratio[0], ratio_max=t.ratio[1], resize=t.resize, flip=t.flip,
        mean=list(t.mean) if t.mean is not None else [], std=list(t.std) if t.std is not None else [],
        layout=t.layout, dtype=t.dtype,
    )


def _three(name: str, values: Sequence[float]) -> tuple[float, float, float] | None:
    if not values:
        return None
    if len(values) != 3:
        raise BadRequest(f"transform.{name} must have 3 values (one per channel) or none, got {len(values)}")
    return (float(values[0]), float(values[1]), float(values[2]))


def spec_defaults(spec: pb.ImageTransformSpec) -> pb.ImageTransformSpec:
    """`spec` with its unset fields (0, "": proto3 cannot tell them from unset) filled in with the
    defaults feed.proto states, where 0 is not a valid value: scale 0.08..1, ratio 3/4..4/3,
    resize floor(size * 8 / 7), layout NCHW, dtype float32. `train`, `flip`, `mean` and `std`
    keep their zero meaning (eval, no flip, no normalization)."""
    out = pb.ImageTransformSpec()
    out.CopyFrom(spec)
    defaults = {"scale_min": 0.08, "scale_max": 1.0, "ratio_min": 3 / 4, "ratio_max": 4 / 3,
                "resize": spec.size * 8 // 7, "layout": "NCHW", "dtype": "float32"}
    for name, value in defaults.items():
        if not getattr(out, name):
            setattr(out, name, value)
    return out


def spec_to_transform(spec: pb.ImageTransformSpec, *, max_side: int) -> ImageTransform:
    """An ImageTransform from the wire, unset fields defaulted (`spec_defaults`) and validated
    (BadRequest / OverLimit name the bad value)."""
    spec = spec_defaults(spec)
    if spec.size < 1:
        raise BadRequest(f"transform.size must be >= 1 pixel, got {spec.size}")
    if spec.layout not in ("NCHW", "NHWC"):
        raise BadRequest(f"transform.layout must be 'NCHW' or 'NHWC', got {spec.layout!r}")
    if spec.dtype not in ("float32", "float16", "uint8"):
        raise BadRequest(f"transform.dtype must be 'float32', 'float16' or 'uint8', got {spec.dtype!r}")
    for name in ("size", "resize"):
        if getattr(spec, name) > max_side:
            raise OverLimit(
                f"transform.{name} {getattr(spec, name)} is over the server's limit of {max_side} pixels"
            )
    if not spec.train and spec.resize < spec.size:
        raise BadRequest(f"transform.resize ({spec.resize}) must be >= transform.size ({spec.size}) "
                         "for the eval transform (resize, then center crop)")
    if spec.train and not (0 < spec.scale_min <= spec.scale_max <= 1):
        raise BadRequest(f"transform scale range must satisfy 0 < min <= max <= 1, got "
                         f"({spec.scale_min}, {spec.scale_max})")
    if spec.train and not (0 < spec.ratio_min <= spec.ratio_max):
        raise BadRequest(f"transform ratio range must satisfy 0 < min <= max, got "
                         f"({spec.ratio_min}, {spec.ratio_max})")
    if not 0 <= spec.flip <= 1:
        raise BadRequest(f"transform.flip is a probability in [0, 1], got {spec.flip}")
    std = _three("std", spec.std)
    if std is not None and min(std) <= 0:
        raise BadRequest(f"transform.std values must be > 0, got {list(std)}")
    return ImageTransform(
        size=spec.size, train=spec.train, scale=(spec.scale_min, spec.scale_max),
        ratio=(spec.ratio_min, spec.ratio_max), resize=spec.resize, flip=spec.flip,
        mean=_three("mean", spec.mean), std=std, layout=spec.layout, dtype=spec.dtype,
    )
