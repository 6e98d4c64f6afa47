"""Aligned tar members: the byte layout of one shard.

Invariant: every payload of `ALIGN_MIN_NBYTES` (4 KiB) or more starts at a file offset that is a
multiple of `ALIGN` (4096), so GDS can read it straight into device memory without a bounce
buffer. The padding is a PAX extended header (`comment=` record, which every reader ignores) placed
before the member; GNU tar, Python's tarfile, webdataset and DALI's `readers.webdataset` read such
shards unchanged. Smaller payloads get a plain ustar header and no padding.

Headers are the bytes Python's `tarfile.TarInfo.tobuf(USTAR_FORMAT)` gives (3.11+: no device
numbers for regular files), formatted here directly (`ustar_header`, about 10x faster than
building a `TarInfo` per member: the header was a third of the writer's time per sample); a test
checks them against `tarfile`. Output is deterministic: fixed mtime, uid/gid 0, mode 0644, no user or group names, so the same
input gives the same bytes on any machine.
"""

from __future__ import annotations

import functools
import tarfile
from typing import BinaryIO

BLOCK = 512
ALIGN = 4096
ALIGN_MIN_NBYTES = 4096
# Fixed mtime (2020-01-01T00:00:00Z) keeps output byte-identical across runs and hosts.
MTIME = 1577836800
_USTAR_NAME_MAX = 100


def _pax_record(keyword: str, value: bytes) -> bytes:
    """One PAX record `"LEN KEYWORD=VALUE\\n"`, where LEN counts the whole record."""
    body = b" " + keyword.encode("ascii") + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode("ascii") + body


def _info(name: str, size: int, type_: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = type_
    return info


def _ustar(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


_USTAR_MAX_SIZE = 8**11 - 1  # what 11 octal digits hold; tarfile refuses more in USTAR format
_MODE_IDS = b"0000644\0" + b"0000000\0" * 2  # mode 0644, uid 0, gid 0
_MTIME_FIELD = b"%011o\0" % MTIME
_TAIL = b"\0" * 100 + b"ustar\x0000" + b"\0" * (32 + 32 + 8 + 8 + 155 + 12)  # linkname .. padding
# the header's checksum over its fixed fields; the checksum field itself counts as 8 spaces
_CHECKSUM_FIXED = sum(_MODE_IDS) + sum(_MTIME_FIELD) + 8 * 32 + sum(_TAIL)


def ustar_header(name: str, size: int, type_: bytes = tarfile.REGTYPE) -> bytes:
    """The 512-byte ustar header `_ustar(_info(name, size, type_))` gives, for an ASCII `name` of
    at most 100 bytes (longer or other names go through `_ustar`)."""
    raw = name.encode("ascii")
    if len(raw) > _USTAR_NAME_MAX or size > _USTAR_MAX_SIZE or size < 0:
        return _ustar(_info(name, size, type_))
    size_field = b"%011o\0" % size
    checksum = _CHECKSUM_FIXED + sum(raw) + sum(size_field) + type_[0]  # (padding NULs add nothing)
    return raw.ljust(100, b"\0") + _MODE_IDS + size_field + _MTIME_FIELD + b"%06o\0 " % checksum + type_ + _TAIL


def _pax_block(records: bytes) -> bytes:
    """A PAX extended header (header block + records padded to whole blocks)."""
    hdr = ustar_header("././@PaxHeader", len(records), tarfile.XHDTYPE)
    pad = -len(records) % BLOCK
    return hdr + records + b"\0" * pad


def needs_alignment(nbytes: int) -> bool:
    return nbytes >= ALIGN_MIN_NBYTES


def member_header(name: str, size: int, offset: int, *, align: bool | None = None) -> bytes:
    """Header bytes to write at file `offset` so that the payload that follows starts aligned.

    `offset` must be a multiple of 512 (tar members always start on a block). The payload of
    `size` bytes begins at `offset + len(result)`; it is a multiple of `ALIGN` whenever `align` is
    true (default: when `size >= ALIGN_MIN_NBYTES`). Names longer than 100 bytes or not ASCII go
    into a PAX `path` record, so no name is ever truncated.
    """
    if offset % BLOCK:
        raise ValueError(f"tar member offset {offset} is not a multiple of {BLOCK}")
    if align is None:
        align = needs_alignment(size)
    raw_name = name.encode("utf-8")
    long_name = len(raw_name) > _USTAR_NAME_MAX or not name.isascii()
    records = _pax_record("path", raw_name) if long_name else b""
    ustar_name = name if not long_name else raw_name[:_USTAR_NAME_MAX].decode("ascii", "replace")
    main = ustar_header(ustar_name if name.isascii() else "long-name", size)
    head = _pax_block(records) if records else b""
    if not align or (offset + len(head) + len(main)) % ALIGN == 0:
        return head + main
    # The PAX data grows to k blocks, the smallest k that holds the records and ends the header
    # run (PAX header block, k data blocks, main header) on an ALIGN boundary.
    min_blocks = max(1, -(-len(records) // BLOCK))
    k = min_blocks + (-(offset + BLOCK + len(main)) // BLOCK - min_blocks) % (ALIGN // BLOCK)
    buf = (_padded_pax(records, k) if records else _align_pax(k)) + main
    if (offset + len(buf)) % ALIGN:
        raise AssertionError(f"could not align member {name!r} at offset {offset}")  # unreachable
    return buf


def _padded_pax(records: bytes, k: int) -> bytes:
    """`records` and a comment record in a PAX block of `k` data blocks. The comment's length is
    aimed mid-block, so its own length digits cannot push it across a block boundary."""
    pad = max(1, k * BLOCK - BLOCK // 2 - len(records) - len(_pax_record("comment", b"")))
    return _pax_block(records + _pax_record("comment", b"x" * pad))


@functools.lru_cache(maxsize=None)
def _align_pax(k: int) -> bytes:
    """`_padded_pax(b"", k)`, made once per k: what every short-named aligned member gets."""
    return _padded_pax(b"", k)


def end_of_archive() -> bytes:
    """Two zero blocks; GNU tar pads archives to 10 KiB records but readers do not need it."""
    return b"\0" * (2 * BLOCK)


def write_member(f: BinaryIO, offset: int, name: str, payload: bytes | memoryview) -> tuple[int, int]:
    """Write one member at `offset`; return `(data_offset, next_offset)`."""
    hdr = member_header(name, len(payload), offset)
    f.write(hdr)
    data_offset = offset + len(hdr)
    f.write(payload)
    pad = -len(payload) % BLOCK
    if pad:
        f.write(b"\0" * pad)
    return data_offset, data_offset + len(payload) + pad
