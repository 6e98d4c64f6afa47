"""CRC32 of shard members (zlib's polynomial: what the index stores and `gdsload verify` checks).

`crc32(data, value=0)` is ISA-L's (`isal.isal_zlib.crc32`, PCLMUL/VPCLMUL kernels, ~50 GB/s per
core on this project's 2-core VMs against ~6.5 GB/s for CPython's `zlib.crc32`), with the
standard library's as the fallback where the `isal` wheel is missing. Both give the same value
for the same bytes. The loader's default `verify="fast"` checks every staged member, so at
35 KB per image this is the difference between the check costing ~5 µs and ~0.7 µs a sample.

`crc32_combine(crc1, crc2, len2)`, the CRC32 of A + B from those of A and B (`len2` = len(B)),
is ISA-L's; None without `isal` (the standard library has none).
"""

from __future__ import annotations

from collections.abc import Callable

crc32_combine: Callable[[int, int, int], int] | None
try:
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - a platform without the isal wheel
    from zlib import crc32

    crc32_combine = None

__all__ = ["crc32", "crc32_combine"]
