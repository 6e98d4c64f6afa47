"""`.npy` payloads with 4 KiB-aligned array data: `gdsload.format.npy`."""

from __future__ import annotations

import io

import numpy as np
import pytest
from npykit import npy_bytes

from gdsload.errors import FormatError
from gdsload.format import npy
from gdsload.format.tar import ALIGN


def _load(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)


ARRAYS = {
    "f4-2d": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "f2": np.linspace(-3, 3, 1000).astype(np.float16),
    "f8-3d": np.random.default_rng(0).standard_normal((5, 6, 7)),
    "i8-scalar": np.array(42, dtype=np.int64),
    "u1-empty": np.zeros((0, 5), np.uint8),
    "bool": np.array([True, False, True]),
    "c16": (np.arange(6) + 1j * np.arange(6)).reshape(2, 3),
    "i2-big-endian": np.arange(3000, dtype=">i2"),
    "fortran": np.asfortranarray(np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)),
    "fortran-f2": np.asfortranarray(np.random.default_rng(1).standard_normal((40, 70)).astype(np.float16)),
    "structured": np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
    "unicode": np.array(["ab", "cde"]),
    "big": np.random.default_rng(2).integers(0, 1 << 30, size=(64, 64), dtype=np.int32),
}


def _fortran(a: np.ndarray) -> bool:
    return a.flags.f_contiguous and not a.flags.c_contiguous


@pytest.mark.parametrize("name", list(ARRAYS))
def test_aligned_header_is_one_block(name: str) -> None:
    a = ARRAYS[name]
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    hdr = npy.aligned_header(a.dtype, a.shape, fortran)
    assert len(hdr) == ALIGN
    assert hdr.startswith(npy.MAGIC + b"\x01\x00")
    assert hdr.endswith(b"\n")
    dtype, shape, fo, data_off = npy.parse_header(hdr)
    assert (dtype, shape, fo, data_off) == (a.dtype, a.shape, fortran, ALIGN)


@pytest.mark.parametrize("name", list(ARRAYS))
def test_encode_is_loadable_and_aligned(name: str) -> None:
    a = ARRAYS[name]
    enc = npy.encode(a)
    assert npy.parse_header(enc)[2:] == (False, ALIGN)  # C order, aligned data
    assert len(enc) == ALIGN + a.nbytes
    b = _load(enc)
    assert b.dtype == a.dtype and b.shape == a.shape and b.flags.c_contiguous
    np.testing.assert_array_equal(b, a)
    # the payload is an ordinary file for numpy, mmap included
    if a.dtype.names is None and a.size:
        mm = np.load(io.BytesIO(enc), mmap_mode=None)
        np.testing.assert_array_equal(mm, a)


@pytest.mark.parametrize("name", list(ARRAYS))
@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
def test_realign_preserves_values(name: str, version) -> None:
    a = ARRAYS[name]
    if version is None:
        src = npy_bytes(a)
    else:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, a, version=version)
        src = buf.getvalue()
    out = npy.realign(src)
    dtype, shape, fortran, data_off = npy.parse_header(out)
    assert data_off == ALIGN
    assert (dtype, shape) == (a.dtype, a.shape)
    assert not fortran  # stored payloads are always C-ordered
    b = _load(out)
    assert b.dtype == a.dtype and b.flags.c_contiguous
    np.testing.assert_array_equal(b, a)
    # the array bytes are the source's in C order: verbatim when the source was C-ordered
    assert out[ALIGN:] == a.tobytes(order="C")
    if not _fortran(a):
        assert out[ALIGN:] == src[npy.parse_header(src)[3] :]
    # realigning an aligned payload is the identity
    assert npy.realign(out) == out


@pytest.mark.parametrize("name", list(ARRAYS))
def test_normalize_stores_c_order_and_reports_fortran(name: str) -> None:
    """Fortran-ordered inputs (any size) come back C-ordered with equal values; the flag says so."""
    a = ARRAYS[name]
    src = npy_bytes(a)
    out, was_fortran = npy.normalize(src)
    assert was_fortran == _fortran(a)
    assert not npy.parse_header(out)[2]
    b = _load(out)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, a)
    if len(out) >= ALIGN:
        assert npy.parse_header(out)[3] == ALIGN
    elif not was_fortran:
        assert out == src  # small C-ordered payloads are stored as given
    # the bytes a C-ordered reader copies are the array's C-order bytes
    assert bytes(out[npy.parse_header(out)[3]:]) == a.tobytes(order="C")


def test_normalize_refuses_a_truncated_small_payload() -> None:
    src = npy_bytes(np.arange(10, dtype=np.int32))
    with pytest.raises(FormatError, match="says 40"):
        npy.normalize(src[:-4])


def test_realign_accepts_memoryview() -> None:
    a = ARRAYS["big"]
    out = npy.realign(memoryview(npy_bytes(a)))
    np.testing.assert_array_equal(_load(out), a)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\x93NUMP",
        b"NOTNPY" + b"\x01\x00" + b"\x00" * 100,
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 200,
        b"\xff\xd8\xff\xe0" + b"\x00" * 5000,
    ],
)
def test_bad_magic(bad: bytes) -> None:
    with pytest.raises(FormatError, match="npy"):
        npy.parse_header(bad)
    with pytest.raises(FormatError):
        npy.realign(bad)


def test_truncated_header() -> None:
    full = npy_bytes(ARRAYS["f8-3d"])
    for cut in (9, 10, 20, 64, 127):
        with pytest.raises(FormatError):
            npy.parse_header(full[:cut])


def _raw_npy(header_text: str, nbytes: int = 12) -> bytes:
    body = header_text.encode("latin1").ljust(117) + b"\n"
    return npy.MAGIC + b"\x01\x00" + len(body).to_bytes(2, "little") + body + b"\0" * nbytes


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '<f4', 'fortran_order': False}",  # no shape
        "{'descr': 'zz9', 'fortran_order': False, 'shape': (3,), }",  # unknown dtype
        "{'descr': '<f4', 'fortran_order': False, 'shape': 'x', }",  # shape not a tuple
        "[1, 2, 3]",  # not a dict
        "{'descr': open, 'fortran_order': False, 'shape': (3,), }",  # not a literal
    ],
)
def test_malformed_header_dict(text: str) -> None:
    with pytest.raises(FormatError, match="npy"):
        npy.parse_header(_raw_npy(text))
    with pytest.raises(FormatError):
        npy.realign(_raw_npy(text))


def test_unbalanced_header_is_format_error() -> None:
    data = _raw_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3,}")
    with pytest.raises(FormatError):
        npy.parse_header(data)


def test_unsupported_version() -> None:
    good = npy_bytes(ARRAYS["f4-2d"])
    bad = good[:6] + b"\x07\x00" + good[8:]
    with pytest.raises(FormatError):
        npy.parse_header(bad)


@pytest.mark.parametrize("delta", [-1, -100, +1, +4096])
def test_truncated_or_extended_data(delta: int) -> None:
    src = npy_bytes(ARRAYS["big"])
    bad = src[:delta] if delta < 0 else src + b"\0" * delta
    with pytest.raises(FormatError, match="bytes"):
        npy.realign(bad)


def test_object_dtype_refused() -> None:
    obj = np.array([{"a": 1}, None, "x"], dtype=object)
    src = npy_bytes(obj, allow_pickle=True)
    with pytest.raises(FormatError, match="object"):
        npy.parse_header(src)
    with pytest.raises(FormatError):
        npy.realign(src + b"\0" * 5000)
    with pytest.raises(FormatError, match="object"):
        npy.aligned_header(np.dtype(object), (3,))
    with pytest.raises(FormatError):
        npy.encode(obj)
    # object fields inside a structured dtype as well
    with pytest.raises(FormatError):
        npy.aligned_header(np.dtype([("a", "<i4"), ("o", object)]), (2,))


def test_header_too_large_for_one_block() -> None:
    with pytest.raises(FormatError, match="fit"):
        npy.aligned_header(np.dtype(np.uint8), (1,) * 2000)


def test_realign_v3_utf8_field_names() -> None:
    a = np.zeros(1000, dtype=[("ключ", "<f8"), ("b", "<i4")])
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, version=(3, 0))
    out = npy.realign(buf.getvalue())
    assert _load(out).dtype == a.dtype


def test_realign_v3_ascii_header() -> None:
    a = np.arange(2000, dtype=np.float32).reshape(40, 50)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, version=(3, 0))
    out = npy.realign(buf.getvalue())
    assert npy.parse_header(out)[3] == ALIGN
    np.testing.assert_array_equal(_load(out), a)
