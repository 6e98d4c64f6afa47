"""The decode-time input-pixel limit (`ImageTransform.max_pixels`) and the header reader behind it.

Every format DALI decodes is written by Pillow and its size read back from the header alone; a
JPEG whose frame header says 16000 x 16000 (a real JPEG with its SOF patched, so the test needs
neither 1.8 GB nor seconds of encoding) is refused before DALI sees it, by the `on_error` policy.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.decode.image import MAX_PIXELS, ImageTransform
from gdsload.decode.imagesize import image_size
from gdsload.loader.dataloader import DataLoader

EVAL = dict(train=False, size=32, resize=36, mean=None, std=None, dtype="uint8", layout="NHWC")

FORMATS = [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}), ("BMP", {}), ("TIFF", {}),
           ("TIFF", {"compression": "tiff_lzw"}), ("PPM", {}), ("WEBP", {}), ("WEBP", {"lossless": True}),
           ("JPEG2000", {}), ("JPEG2000", {"no_jp2": True})]


def _encode(size: tuple[int, int], fmt: str = "JPEG", mode: str = "RGB", **kw) -> bytes:
    rng = np.random.default_rng(size[0] * 7919 + size[1])
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, kw", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("size", [(53, 37), (1, 640), (4000, 3)])
def test_image_size_from_the_header(fmt: str, kw: dict, size: tuple[int, int]) -> None:
    if fmt == "JPEG2000" and not features.check("jpg_2000") or fmt == "WEBP" and not features.check("webp"):
        pytest.skip(f"Pillow without {fmt}")
    data = _encode(size, fmt, **kw)
    assert image_size(data) == size
    assert image_size(np.frombuffer(data, np.uint8)) == size  # a view of the ring's staging memory


def test_image_size_other_modes_and_big_exif() -> None:
    assert image_size(_encode((40, 30), "PPM", mode="L")) == (40, 30)  # PGM
    assert image_size(_encode((40, 30), "WEBP", mode="RGBA")) == (40, 30)  # VP8X
    exif = b"Exif\x00\x00" + bytes(60000)  # an APP1 segment before the frame header
    assert image_size(_encode((40, 30), exif=exif)) == (40, 30)


@pytest.mark.parametrize("data", [b"", b"\xff\xd8", b"\xff\xd8\xff\xe0\x00", b"GIF89a\x10\x00\x10\x00",
                                  b"not an image at all", _encode((20, 10))[:40], b"\x89PNG\r\n\x1a\n" + b"\0" * 4])
def test_image_size_unknown_or_cut_short_is_none(data: bytes) -> None:
    assert image_size(data) is None


def _huge_jpeg(w: int = 16000, h: int = 16000) -> bytes:
    """A small real JPEG whose frame header (SOF0) claims w x h."""
    data = bytearray(_encode((64, 48)))
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, h, w)
    assert image_size(bytes(data)) == (w, h)
    return bytes(data)


def test_default_limit_refuses_16000_squared() -> None:
    assert 16000 * 16000 > MAX_PIXELS >= 8192 * 8192
    assert ImageTransform().max_pixels == MAX_PIXELS
    with pytest.raises(ValueError, match="max_pixels"):
        ImageTransform(max_pixels=0)


@pytest.fixture(scope="module")
def huge_ds(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("huge")
    for c in ("a", "b"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(3):
            (root / "src" / c / f"img{i}.jpg").write_bytes(_encode((80 + 10 * i, 60)))
    (root / "src" / "b" / "big.jpg").write_bytes(_huge_jpeg())
    convert(str(root / "src"), root / "ds", ConvertOptions(workers=1, progress=False))
    return root / "ds", "b/big"


@pytest.mark.dali
def test_over_limit_image_raises_decode_error_naming_shard_and_key(huge_ds) -> None:
    from gdsload.decode.image import DecodeError

    ds, key = huge_ds
    loader = DataLoader(str(ds), batch_size=7, device="cpu", output="numpy", transform=ImageTransform(**EVAL))
    with pytest.raises(DecodeError, match=rf"shard-000000\.tar:{key} is 16000 x 16000 pixels, over the limit "
                                          rf"of {MAX_PIXELS}.*on_error='skip'"):
        next(iter(loader))
    loader.close()


@pytest.mark.dali
def test_over_limit_image_is_skipped_and_counted(huge_ds) -> None:
    ds, key = huge_ds
    loader = DataLoader(str(ds), batch_size=3, device="cpu", output="numpy", on_error="skip",
                        transform=ImageTransform(**EVAL))
    keys = []
    for b in loader:
        assert b["jpg"].shape == (len(b["__key__"]), 32, 32, 3) and len(b["cls"]) == len(b["__key__"])
        keys += b["__key__"]
    assert sorted(keys) == sorted(f"{c}/img{i}" for c in "ab" for i in range(3))
    assert loader.stats()["skipped"] == 1
    loader.close()


@pytest.mark.dali
def test_the_limit_is_the_transforms_setting(huge_ds) -> None:
    """A limit below some real images' sizes refuses exactly those."""
    ds, _ = huge_ds
    loader = DataLoader(str(ds), batch_size=7, device="cpu", output="numpy", on_error="skip", fields=["jpg"],
                        transform=ImageTransform(**EVAL, max_pixels=90 * 60))
    kept = sum(len(b[0]) for b in loader)
    assert kept == 4 and loader.stats()["skipped"] == 3  # 80x60 and 90x60 pass, 100x60 and big do not
    loader.close()
