"""Image width and height from the first bytes of an encoded image, without decoding it.

The loader refuses images over a pixel limit before DALI allocates for them
(`ImageTransform.max_pixels`), so it needs their size cheaply: a few `struct` reads of the header
(microseconds per image, no allocation, never the pixel data). Formats are those DALI's image
decoders read: JPEG (the SOF segment, skipping APP/EXIF segments), PNG (IHDR), BMP, TIFF (IFD0),
WebP (VP8, VP8L, VP8X), PNM and JPEG 2000 (JP2 `ihdr` box or a raw codestream's SIZ segment).
`image_size` returns None for anything else and for headers it cannot follow; such data is left
to the decoder, which then refuses it as corrupt or decodes it.
"""

from __future__ import annotations

import struct
from typing import Any

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0..SOF15 but DHT, JPG, DAC
_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: markers without a segment


def image_size(data: Any) -> tuple[int, int] | None:
    """(width, height) of an encoded image in `data` (bytes, memoryview or a uint8 array)."""
    b = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    try:
        head = bytes(b[:12])
        if head[:2] == b"\xff\xd8":
            return _jpeg(b)
        if head[:8] == b"\x89PNG\r\n\x1a\n":
            return _positive(*struct.unpack_from(">II", b, 16)) if bytes(b[12:16]) == b"IHDR" else None
        if head[:2] == b"BM":
            return _bmp(b)
        if head[:4] in (b"II*\x00", b"MM\x00*"):
            return _tiff(b, "<" if head[0] == 0x49 else ">")
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp(b)
        if head[:1] == b"P" and head[1:2] in b"123456" and len(head) > 2:
            return _pnm(bytes(b[:1024]))
        if head[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n":
            return _jp2(b)
        if head[:4] == b"\xff\x4f\xff\x51":  # a raw JPEG 2000 codestream: SOC, then SIZ
            xs, ys, xo, yo = struct.unpack_from(">IIII", b, 8)
            return _positive(xs - xo, ys - yo)
    except (struct.error, IndexError, ValueError):  # a header cut short
        return None
    return None


def _positive(w: int, h: int) -> tuple[int, int] | None:
    return (w, h) if w > 0 and h > 0 else None


def _jpeg(b: Any) -> tuple[int, int] | None:
    i, n = 2, len(b)
    while i + 4 <= n:
        if b[i] != 0xFF:
            return None
        m = b[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
        elif m in _NO_LENGTH:
            i += 2
        elif m in _SOF:
            h, w = struct.unpack_from(">HH", b, i + 5)
            return _positive(w, h)  # height 0: defined later by a DNL segment, unknown here
        elif m in (0xDA, 0xD9):  # scan data or end of image before any frame header
            return None
        else:
            i += 2 + struct.unpack_from(">H", b, i + 2)[0]
    return None


def _bmp(b: Any) -> tuple[int, int] | None:
    if struct.unpack_from("<I", b, 14)[0] == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sizes
        return _positive(*struct.unpack_from("<HH", b, 18))
    w, h = struct.unpack_from("<ii", b, 18)
    return _positive(w, abs(h))  # negative height: rows stored top-down


def _tiff(b: Any, order: str) -> tuple[int, int] | None:
    ifd = struct.unpack_from(order + "I", b, 4)[0]
    dims: dict[int, int] = {}
    for k in range(struct.unpack_from(order + "H", b, ifd)[0]):
        tag, typ = struct.unpack_from(order + "HH", b, ifd + 2 + 12 * k)
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT or LONG, stored inline
            dims[tag] = struct.unpack_from(order + ("H" if typ == 3 else "I"), b, ifd + 2 + 12 * k + 8)[0]
    return _positive(dims.get(256, 0), dims.get(257, 0))


def _webp(b: Any) -> tuple[int, int] | None:
    chunk = bytes(b[12:16])
    if chunk == b"VP8 " and bytes(b[23:26]) == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", b, 26)
        return _positive(w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L" and b[20] == 0x2F:
        bits = struct.unpack_from("<I", b, 21)[0]
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        w = int.from_bytes(bytes(b[24:27]), "little") + 1
        h = int.from_bytes(bytes(b[27:30]), "little") + 1
        return w, h
    return None


def _pnm(head: bytes) -> tuple[int, int] | None:
    tokens: list[int] = []
    for line in head[2:].split(b"\n"):
        for tok in line.split(b"#", 1)[0].split():
            tokens.append(int(tok))
            if len(tokens) == 2:
                return _positive(*tokens)
    return None


def _jp2(b: Any) -> tuple[int, int] | None:
    i, n = 0, len(b)
    while i + 8 <= n:
        size, kind = struct.unpack_from(">I4s", b, i)
        if kind == b"jp2h":  # a superbox: its first child is ihdr (height, width)
            if bytes(b[i + 12 : i + 16]) == b"ihdr":
                h, w = struct.unpack_from(">II", b, i + 16)
                return _positive(w, h)
            return None
        if size < 8:  # 0 (to the end) or 1 (64-bit size): not before jp2h in a valid file
            return None
        i += size
    return None
