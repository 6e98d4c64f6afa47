"""`.npy` payloads whose array data is 4 KiB-aligned.

The npy header (magic, version, length, dict literal) is padded with spaces so that header plus
preamble fill exactly `ALIGN` bytes; the payload itself starts at an aligned file offset, so the
array data does too and a tensor can be read straight into device memory. The result is an
ordinary npy v1.0 file that `numpy.load` reads (its header stays under NumPy's 10,000-byte safety
limit).

Stored payloads are always C-ordered: the loader copies array data straight into rows of a
C-ordered batch tensor, so a Fortran-ordered input (`fortran_order: True`, as `np.save` writes
for `np.asfortranarray`) is rewritten in C order at conversion (`normalize`: same values, dtype
and shape; only the memory layout changes), never stored as is.
"""

from __future__ import annotations

import io
import threading
import warnings

import numpy as np
from numpy.lib import format as npformat

from gdsload.errors import FormatError
from gdsload.format.tar import ALIGN

MAGIC = b"\x93NUMPY"
_PREAMBLE = len(MAGIC) + 2 + 2  # magic, version (1.0), header length (uint16)


def aligned_header(dtype: np.dtype, shape: tuple[int, ...], fortran_order: bool = False) -> bytes:
    """An npy header exactly `ALIGN` bytes long: version 1.0 (latin-1), or 3.0 (UTF-8) when a
    structured dtype's field names need it."""
    if dtype.hasobject:
        raise FormatError(f"npy arrays of dtype {dtype} hold Python objects and cannot be stored")
    text = "{'descr': %r, 'fortran_order': %r, 'shape': %r, }" % (
        npformat.dtype_to_descr(dtype),
        bool(fortran_order),
        tuple(int(d) for d in shape),
    )
    try:
        raw, version, len_bytes = text.encode("latin1"), b"\x01\x00", 2
    except UnicodeEncodeError:
        raw, version, len_bytes = text.encode("utf8"), b"\x03\x00", 4
    body_len = ALIGN - len(MAGIC) - 2 - len_bytes
    if len(raw) + 1 > body_len:
        raise FormatError(f"npy header for shape {shape} does not fit in {ALIGN} bytes")
    body = raw.ljust(body_len - 1) + b"\n"
    return MAGIC + version + body_len.to_bytes(len_bytes, "little") + body


def _read_v3(f: io.BytesIO):
    import importlib

    for mod in ("numpy.lib._format_impl", "numpy.lib.format"):
        reader = getattr(importlib.import_module(mod), "_read_array_header", None)
        if reader is not None:
            return reader(f, (3, 0), max_header_size=1 << 20)
    raise FormatError("this NumPy cannot read .npy version 3.0 headers")


# NumPy parses npy headers with `ast.literal_eval`, which can raise SystemError ("AST constructor
# recursion depth mismatch") when threads run it at once on CPython 3.11 (seen in the loader's
# producer threads); that would pass for a malformed header, so headers are parsed one at a time.
_HEADER_LOCK = threading.Lock()


def parse_header(buf: bytes | memoryview) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Parse an npy header from the start of `buf`: (dtype, shape, fortran_order, data_offset).

    Raises FormatError for anything that is not an npy file, without reading past the header.
    """
    head = bytes(buf[:_PREAMBLE + 2])
    if len(head) < _PREAMBLE or head[:6] != MAGIC:
        raise FormatError("not an .npy file (bad magic)")
    f = io.BytesIO(bytes(buf[: min(len(buf), 1 << 20)]))
    try:
        with _HEADER_LOCK:
            version = npformat.read_magic(f)
            if version not in ((1, 0), (2, 0), (3, 0)):
                raise FormatError(f"unsupported .npy version {version}")
            if version == (1, 0):
                shape, fortran, dtype = npformat.read_array_header_1_0(f, max_header_size=1 << 20)
            elif version == (2, 0):
                shape, fortran, dtype = npformat.read_array_header_2_0(f, max_header_size=1 << 20)
            else:  # 3.0 headers are UTF-8; numpy reads them only through its private helper
                shape, fortran, dtype = _read_v3(f)
    except FormatError:
        raise
    except Exception as exc:  # ValueError, SyntaxError, tokenize.TokenError...: a bad header
        raise FormatError(f"malformed .npy header: {type(exc).__name__}: {exc}") from exc
    if dtype.hasobject:
        raise FormatError(f"npy arrays of dtype {dtype} hold Python objects and are refused")
    return dtype, tuple(shape), bool(fortran), f.tell()


def _array_data(payload: bytes | memoryview) -> tuple[np.dtype, tuple[int, ...], bool, int, memoryview]:
    """Header fields plus the array data, whose length is checked against the header."""
    dtype, shape, fortran, data_off = parse_header(payload)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    data = memoryview(payload)[data_off:]
    if len(data) != nbytes:
        raise FormatError(
            f".npy data is {len(data)} bytes but its header (shape {shape}, dtype {dtype}) "
            f"says {nbytes}"
        )
    return dtype, shape, fortran, data_off, data


def _c_order(dtype: np.dtype, shape: tuple[int, ...], data: memoryview) -> bytes:
    """Fortran-ordered array data rewritten in C order (values unchanged)."""
    return np.ndarray(shape, dtype, buffer=data, order="F").tobytes(order="C")


def realign(payload: bytes | memoryview) -> bytes:
    """Rewrite an npy file so its array data is C-ordered and sits `ALIGN` bytes after the payload
    start.

    C-ordered array bytes are copied unchanged; the data length is checked against the header.
    """
    dtype, shape, fortran, data_off, data = _array_data(payload)
    if fortran:
        return aligned_header(dtype, shape) + _c_order(dtype, shape, data)
    if data_off == ALIGN:
        return bytes(payload)
    return aligned_header(dtype, shape) + bytes(data)


def normalize(payload: bytes | memoryview) -> tuple[bytes | memoryview, bool]:
    """What the writer stores for an `.npy` payload, and whether it was Fortran-ordered.

    Payloads of `ALIGN` bytes or more come back `realign`ed; smaller ones as given, or, if
    Fortran-ordered, rewritten in C order with an ordinary (unpadded) npy header. Raises
    FormatError for anything that is not a well-formed `.npy` file.
    """
    dtype, shape, fortran, data_off, data = _array_data(payload)
    if len(payload) >= ALIGN:
        return realign(payload), fortran
    if not fortran:
        return payload, False
    c = np.ndarray(shape, dtype, buffer=_c_order(dtype, shape, data))
    buf = io.BytesIO()
    with warnings.catch_warnings():  # a structured dtype with non-ASCII names needs version 3.0
        warnings.simplefilter("ignore", UserWarning)
        npformat.write_array(buf, c, version=None, allow_pickle=False)
    out = buf.getvalue()
    if len(out) >= ALIGN:  # the new header pushed it over: store it aligned like any big payload
        out = aligned_header(dtype, shape) + c.tobytes()
    return out, True


def encode(array: np.ndarray) -> bytes:
    """An aligned npy payload for `array` (in C order, whatever the layout of `array`)."""
    array = np.asarray(array)
    return aligned_header(array.dtype, array.shape) + array.tobytes(order="C")


def encode_stored(array: np.ndarray) -> bytes:
    """The npy payload a shard stores for `array` (C order): the rule `normalize` applies to a
    converted `.npy` file. With NumPy's own (unpadded) header when the payload is then under
    `ALIGN` bytes, so a small array (a 514-byte row of tokens) does not pay a 4 KiB header: the
    shard packs it (the loader reads such members unaligned, parsing each header); otherwise
    `encode`d, its array data `ALIGN` bytes in, so arrays of 4 KiB and more start on 4 KiB
    boundaries in the shard."""
    array = np.asarray(array)
    if array.dtype.hasobject:
        raise FormatError(f"npy arrays of dtype {array.dtype} hold Python objects and cannot be stored")
    if array.nbytes < ALIGN:
        c = array if array.flags.c_contiguous else np.array(array, order="C")
        buf = io.BytesIO()
        with warnings.catch_warnings():  # a structured dtype with non-ASCII names needs version 3.0
            warnings.simplefilter("ignore", UserWarning)
            npformat.write_array(buf, c, version=None, allow_pickle=False)
        out = buf.getvalue()
        if len(out) < ALIGN:
            return out
    return encode(array)
