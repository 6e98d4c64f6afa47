"""Deterministic sample datasets for the demo, the tests and the benchmarks.

Two generators:

* `make_image_folder` writes an ImageNet-style folder ``dst/class_000/img_000000.jpg`` ... of RGB
  JPEGs. Each image is a random crop (random position, 35-100 % of the area, aspect ratio of the
  output, sometimes mirrored) of one of the real photographs bundled inside scikit-image's wheel
  (`PHOTOS`: astronaut, chelsea the cat, coffee, the motorcycle stereo pair, rocket, Hubble deep
  field, immunohistochemistry, camera, brick, grass, gravel, coins; read from the package's data
  folder, no network download; grayscale ones converted to RGB), resized to around ImageNet's
  typical 500x375 (about 30 % portrait; side lengths spread about +-15 %, aspect about +-10 %),
  colour-jittered (saturation, contrast, per-channel gain, brightness), given a little sensor
  noise and an in-camera style 3x3 sharpening so no two images are alike and the files are as
  large as real photographs, and saved at JPEG quality 90 (4:2:0 chroma, Pillow's default).

  Measured at the defaults (``mean_size=(500, 375)``, ``quality=90``, ``seed=0``; scikit-image
  0.26, Pillow 13, 1000 images): mean 105 KB per file (median 100 KB, 5-95 % 60-170 KB, min
  41 KB, max 246 KB), close to ImageNet's train set (about 110 KB); mean size 470x422 pixels
  (landscape and portrait mixed). Generation runs at about 40-50 images/s per CPU core.
  At ``mean_size=(160, 120)`` the files are about 14 KB.

* `make_npy_folder` writes ``dst/sample_000000.npy`` ... arrays of random content (any integer or
  float dtype; ``uint8`` and ``float16`` are the usual ones) and a ``labels.csv`` with header
  ``key,label``.

Determinism: every sample draws from its own random generator seeded by ``(seed, index)``, so the
same seed gives byte-identical files whatever the number of worker processes and in whatever order
they finish. Byte identity holds for the same versions of NumPy, Pillow (and its libjpeg) and
scikit-image; a different libjpeg may encode the same pixels to different bytes.

Every file is written under a temporary name and renamed into place, so an interrupted run leaves
no half-written file behind (only complete files, which a rerun overwrites with the same bytes).

Importing this module needs NumPy only; Pillow and scikit-image (the ``demo`` extra) are imported
when a generator runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gdsload.errors import GdsloadError, require
from gdsload.io.store import write_atomic

__all__ = ["PHOTOS", "available_photos", "make_image_folder", "make_npy_folder"]

#: The photographs (file names in ``skimage/data``) the image generator cuts from, in a fixed
#: order (the order is part of the determinism). All ship inside scikit-image's wheel.
PHOTOS: tuple[str, ...] = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "rocket.jpg",
    "hubble_deep_field.jpg",
    "ihc.png",
    "camera.png",
    "brick.png",
    "grass.png",
    "gravel.png",
    "coins.png",
)

_PURPOSE = "The sample-image generator"
_PORTRAIT_PROBABILITY = 0.3
_SIZE_SPREAD = 0.15  # sigma of log(scale) of the image area's side
_ASPECT_SPREAD = 0.10  # sigma of log(aspect ratio)
_MIN_SIDE = 16
_NOISE_LOW, _NOISE_HIGH = 3.0, 6.0  # standard-deviation range of the sensor noise, 8-bit levels
_TWO_BYTES_STD = float(np.sqrt(2 * (256**2 - 1) / 12))  # std of the sum of two uniform bytes


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GdsloadError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise GdsloadError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _skimage_data_dir() -> Path:
    skimage = require("skimage", extra="demo", purpose=_PURPOSE)
    return Path(skimage.__file__).resolve().parent / "data"


def available_photos() -> list[str]:
    """The names in `PHOTOS` present in the installed scikit-image (all of them in 0.26).

    The generator cuts from these; a scikit-image lacking some would give other images.
    """
    data_dir = _skimage_data_dir()
    return [name for name in PHOTOS if (data_dir / name).is_file()]


@functools.lru_cache(maxsize=1)
def _load_photos() -> tuple[Any, ...]:
    """The source photographs as RGB PIL images, loaded once per process."""
    image_mod = require("PIL.Image", extra="demo", purpose=_PURPOSE)
    data_dir = _skimage_data_dir()
    photos = []
    for name in available_photos():
        with image_mod.open(data_dir / name) as im:
            photos.append(im.convert("RGB"))
    if not photos:
        raise GdsloadError(
            f"no sample photographs found in {data_dir}; expected some of {', '.join(PHOTOS)} "
            "(reinstall scikit-image: pip install 'gdsload[demo]')"
        )
    return tuple(photos)


@functools.lru_cache(maxsize=1)
def _sharpen_kernel() -> Any:
    image_filter = require("PIL.ImageFilter", extra="demo", purpose=_PURPOSE)
    # out = c + 2 * (c - mean of the 8 neighbours): a 3x3 unsharp mask, fast in Pillow.
    return image_filter.Kernel((3, 3), [-1, -1, -1, -1, 12, -1, -1, -1, -1], scale=4)


def _image_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index)])


def _render_image(seed: int, index: int, mean_size: tuple[int, int], quality: int) -> bytes:
    """The JPEG bytes of image `index`: a function of (seed, index, mean_size, quality) only."""
    image_mod = require("PIL.Image", extra="demo", purpose=_PURPOSE)
    image_stat = require("PIL.ImageStat", extra="demo", purpose=_PURPOSE)
    import io

    photos = _load_photos()
    rng = _image_rng(seed, index)
    photo = photos[int(rng.integers(len(photos)))]

    # Output size: area and aspect ratio drawn around mean_size, landscape or portrait.
    mean_w, mean_h = mean_size
    scale = float(np.exp(rng.normal(0.0, _SIZE_SPREAD)))
    aspect = (mean_w / mean_h) * float(np.exp(rng.normal(0.0, _ASPECT_SPREAD)))
    if rng.random() < _PORTRAIT_PROBABILITY:
        aspect = 1.0 / aspect
    area = mean_w * mean_h * scale * scale
    out_w = max(_MIN_SIDE, int(round((area * aspect) ** 0.5)))
    out_h = max(_MIN_SIDE, int(round((area / aspect) ** 0.5)))

    # Crop: the output's aspect ratio, 35-100 % of the photo's area (shrunk to fit), anywhere.
    src_w, src_h = photo.size
    fraction = float(rng.uniform(0.35, 1.0))
    crop_w = (fraction * src_w * src_h * out_w / out_h) ** 0.5
    crop_h = crop_w * out_h / out_w
    fit = min(1.0, src_w / crop_w, src_h / crop_h)
    crop_w, crop_h = min(src_w, crop_w * fit), min(src_h, crop_h * fit)
    x0 = float(rng.uniform(0.0, max(0.0, src_w - crop_w)))
    y0 = float(rng.uniform(0.0, max(0.0, src_h - crop_h)))
    mirror = bool(rng.random() < 0.5)
    resized = photo.resize(
        (out_w, out_h),
        image_mod.Resampling.BICUBIC,
        box=(x0, y0, x0 + crop_w, y0 + crop_h),
    )

    if mirror:
        resized = resized.transpose(image_mod.Transpose.FLIP_LEFT_RIGHT)

    # Colour jitter: saturation s, contrast c (about the image's mean level m), per-channel gains
    # G and a brightness offset b are all affine, so they fold into one 3x4 colour matrix that
    # Pillow applies in C:  out = c * G @ S @ p + G * (1 - c) * m + b,
    # with S = s * I + (1 - s) / 3 * ones (saturation about each pixel's channel mean).
    saturation = float(rng.uniform(0.75, 1.25))
    contrast = float(rng.uniform(0.8, 1.2))
    gains = rng.uniform(0.9, 1.1, size=3)
    brightness = float(rng.uniform(-20.0, 20.0))
    mean_level = float(np.mean(image_stat.Stat(resized).mean))
    sat = saturation * np.eye(3) + (1.0 - saturation) / 3.0 * np.ones((3, 3))
    linear = contrast * gains[:, None] * sat
    offset = gains * (1.0 - contrast) * mean_level + brightness
    matrix = np.concatenate([linear, offset[:, None]], axis=1)
    jittered = resized.convert("RGB", tuple(float(v) for v in matrix.ravel()))

    # Sensor noise: the sum of two uniform random bytes (a triangular distribution, close enough
    # to Gaussian and 3x faster to draw), scaled to a standard deviation of noise_sigma levels.
    noise_sigma = float(rng.uniform(_NOISE_LOW, _NOISE_HIGH))
    count = out_h * out_w * 3
    noise_bytes = np.frombuffer(rng.bytes(2 * count), dtype=np.uint8)
    pixels = noise_bytes[:count].astype(np.float32)
    pixels += noise_bytes[count:]
    pixels -= np.float32(255.0)
    pixels *= np.float32(noise_sigma / _TWO_BYTES_STD)
    pixels = pixels.reshape(out_h, out_w, 3)
    pixels += np.asarray(jittered, dtype=np.float32)
    np.rint(pixels, out=pixels)
    np.clip(pixels, 0, 255, out=pixels)
    out = pixels.astype(np.uint8)

    # In-camera style sharpening: restores the fine detail the upscaling smoothed away (and makes
    # the files as large as real photographs of this size).
    image = image_mod.fromarray(out).filter(_sharpen_kernel())
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    # Generated data can be regenerated: no fsync per file (thousands of images), still no
    # half-written file under its final name.
    write_atomic(path, data, fsync=False)


def _write_images(
    jobs: Sequence[tuple[int, str]], seed: int, mean_size: tuple[int, int], quality: int
) -> int:
    """Render and write `(index, path)` jobs; returns the bytes written."""
    total = 0
    for index, path in jobs:
        data = _render_image(seed, index, mean_size, quality)
        _write_atomic(Path(path), data)
        total += len(data)
    return total


def _width(count: int, minimum: int) -> int:
    return max(minimum, len(str(count - 1)))


def make_image_folder(
    dst: str | os.PathLike[str],
    *,
    num_images: int = 1000,
    num_classes: int = 10,
    seed: int = 0,
    mean_size: tuple[int, int] = (500, 375),
    quality: int = 90,
    workers: int | None = None,
) -> dict[str, Any]:
    """Write an ImageNet-style folder ``dst/CLASS/KEY.jpg`` of realistic RGB JPEGs.

    Classes are ``class_000`` ... ``class_{num_classes-1}``; image ``i`` is ``img_{i:06d}.jpg``
    (keys unique across the folder, no dots) in class ``i % num_classes``. Sizes are drawn around
    ``mean_size`` (width, height); at the defaults the mean file is about 105 KB. The same
    arguments give byte-identical files for any ``workers`` (default ``os.cpu_count()``).
    Existing files of the same names are replaced; other files in ``dst`` are left alone.

    With ``workers > 1`` the images are made in a process pool of the default start method; under
    spawn or forkserver the calling script needs the usual ``if __name__ == "__main__":`` guard.

    Returns ``{"root", "num_images", "num_classes", "classes", "total_bytes", "mean_bytes",
    "seed"}``.
    """
    num_images = _check_positive("num_images", num_images)
    num_classes = _check_positive("num_classes", num_classes)
    quality = _check_positive("quality", quality)
    if quality > 100:
        raise GdsloadError(f"quality must be 1..100, got {quality}")
    if len(mean_size) != 2:
        raise GdsloadError(f"mean_size must be (width, height), got {mean_size!r}")
    size = (_check_positive("mean_size width", mean_size[0]),
            _check_positive("mean_size height", mean_size[1]))
    seed = _check_seed(seed)
    workers = (os.cpu_count() or 1) if workers is None else _check_positive("workers", workers)
    _load_photos()  # fail early (missing scikit-image/Pillow) before creating anything

    root = Path(dst)
    class_width = _width(num_classes, 3)
    key_width = _width(num_images, 6)
    classes = [f"class_{c:0{class_width}d}" for c in range(num_classes)]
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
    jobs = [
        (i, str(root / classes[i % num_classes] / f"img_{i:0{key_width}d}.jpg"))
        for i in range(num_images)
    ]

    workers = min(workers, num_images)
    if workers <= 1:
        total = _write_images(jobs, seed, size, quality)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Small chunks balance the load; each worker loads the photos once.
        chunk = max(1, min(64, num_images // (workers * 4)))
        chunks = [jobs[i : i + chunk] for i in range(0, num_images, chunk)]
        # The platform's default start method (or the one the caller set): fork on Linux before
        # Python 3.14, where the workers inherit the photos already loaded above.
        context = multiprocessing.get_context()
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [pool.submit(_write_images, c, seed, size, quality) for c in chunks]
            total = sum(f.result() for f in futures)

    return {
        "root": str(root),
        "num_images": num_images,
        "num_classes": num_classes,
        "classes": classes,
        "total_bytes": total,
        "mean_bytes": total / num_images,
        "seed": seed,
    }


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    native = dtype.newbyteorder("=")
    if dtype.kind in "ui":
        info = np.iinfo(native)
        array = rng.integers(info.min, info.max, size=shape, dtype=native, endpoint=True)
    elif dtype.kind == "f":
        array = rng.standard_normal(size=shape, dtype=np.float32)
    else:  # "b", checked by the caller
        array = rng.random(size=shape) < 0.5
    return array.astype(dtype, copy=False)


def make_npy_folder(
    dst: str | os.PathLike[str],
    *,
    num_samples: int = 1000,
    shape: Sequence[int] = (3, 224, 224),
    dtype: str | np.dtype[Any] | type = "uint8",
    seed: int = 0,
    labels: bool = True,
    num_classes: int = 10,
) -> dict[str, Any]:
    """Write ``dst/sample_{i:06d}.npy`` arrays of deterministic random content.

    Integer dtypes are uniform over the dtype's range, floats standard normal (drawn as float32
    and cast, so float16 works), bool fair coin flips. With ``labels``, ``dst/labels.csv`` has the
    header ``key,label`` and one row per key in key order, labels in ``0..num_classes-1``. The
    sample and its label come from the generator seeded by ``(seed, index)``.

    Returns ``{"root", "num_samples", "shape", "dtype", "keys", "labels" (list or None),
    "total_bytes", "seed"}``.
    """
    num_samples = _check_positive("num_samples", num_samples)
    num_classes = _check_positive("num_classes", num_classes)
    seed = _check_seed(seed)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise GdsloadError(f"shape must not have negative sides, got {shape}")
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise GdsloadError(f"unknown dtype {dtype!r}") from exc
    if np_dtype.kind not in "uifb" or np_dtype.itemsize > 8:
        raise GdsloadError(f"dtype must be an integer, float or bool type, got {np_dtype}")

    import io

    root = Path(dst)
    root.mkdir(parents=True, exist_ok=True)
    key_width = _width(num_samples, 6)
    keys = [f"sample_{i:0{key_width}d}" for i in range(num_samples)]
    label_values: list[int] = []
    total = 0
    for i, key in enumerate(keys):
        rng = _image_rng(seed, i)
        label_values.append(int(rng.integers(num_classes)))
        array = _random_array(rng, shape, np_dtype)
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        data = buffer.getvalue()
        _write_atomic(root / f"{key}.npy", data)
        total += len(data)

    if labels:
        text = "key,label\n" + "".join(f"{k},{v}\n" for k, v in zip(keys, label_values))
        _write_atomic(root / "labels.csv", text.encode("ascii"))

    return {
        "root": str(root),
        "num_samples": num_samples,
        "shape": shape,
        "dtype": np_dtype.name,
        "keys": keys,
        "labels": label_values if labels else None,
        "total_bytes": total,
        "seed": seed,
    }


def ensure_image_folder(dst: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """`make_image_folder` once: a later call with the folder complete (marker file
    `.complete`, written last) returns the recorded summary without regenerating."""
    import json

    marker = Path(dst) / ".complete"
    if not marker.exists():
        made = make_image_folder(dst, **kwargs)
        marker.write_text(json.dumps(made))
    return json.loads(marker.read_text())
