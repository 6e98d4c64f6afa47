"""Label fields (`.cls`): what counts as a label, checked once at conversion.

A label payload is a decimal integer in ASCII that fits in int64, optionally signed and surrounded
by whitespace (`b"7"`, `b"-1\\n"`); anything else (empty, `b"cat"`, `b"1.5"`, `b"1_0"`, other
Unicode digits, overflow) is refused with `FormatError`. The writer parses every label member
this way and stores the values as an int64 column of the shard index, so the loader copies
labels from the index instead of reading and parsing text per sample; indexes written before the
column existed are parsed by the loader with this same function.
"""

from __future__ import annotations

import re

from gdsload.errors import FormatError
from gdsload.format.manifest import field_kind

_LABEL = re.compile(rb"[ \t\r\n]*[+-]?[0-9]+[ \t\r\n]*")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def is_label(ext: str) -> bool:
    """Whether field `ext` holds labels (`cls`, or `NAME.cls`)."""
    return field_kind(ext) == "label"


def parse_label(data: bytes | memoryview) -> int:
    """The integer a label payload holds; FormatError (saying why, not where) when it holds none."""
    raw = bytes(data)
    if 0 < len(raw) <= 18 and raw.isdigit():  # the common case: plain digits, within int64
        return int(raw)
    if not raw.strip():
        raise FormatError("label is empty (a label is a decimal integer such as b'3')")
    if len(raw) > 64 or not _LABEL.fullmatch(raw):
        raise FormatError(f"label {raw[:40]!r} is not a decimal integer")
    value = int(raw)
    if not _INT64[0] <= value <= _INT64[1]:
        raise FormatError(f"label {raw[:40]!r} does not fit in int64")
    return value
