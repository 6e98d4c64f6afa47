"""CRC32 of shard members (zlib's polynomial: what the index stores and `gdsload verify` checks).

`crc32(data, value=0)` is ISA-L's (`isal.isal_zlib.crc32`, PCLMUL/VPCLMUL kernels, ~50 GB/s per
core on this project's 2-core VMs against ~6.5 GB/s for CPython's `zlib.crc32`), with the
standard library's as the fallback where the `isal` wheel is missing. Both give the same value
for the same bytes. The loader's default `verify="fast"` checks every staged member, so at
35 KB per image this is the difference between the check costing ~5 µs and ~0.7 µs a sample.

`crc32_combine(crc1, crc2, len2)`, the CRC32 of A + B from those of A and B (`len2` = len(B)),
is ISA-L's; None without `isal` (the standard library has none).

`first_mismatch(buf, pos, nbytes, expected)` checks many members of one buffer against their
CRC32s, a run of back-to-back members in one `crc32` call: the loader's check of staged members
(`gdsload.dataset.verify.check_crcs`) and the feed client's of members sent as stored
(`gdsload.service.protocol.wire.decode_body`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

crc32_combine: Callable[[int, int, int], int] | None
try:
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - a platform without the isal wheel
    from zlib import crc32

    crc32_combine = None

__all__ = ["crc32", "crc32_combine", "first_mismatch"]


def first_mismatch(buf: Any, pos: np.ndarray, nbytes: np.ndarray,
                   expected: np.ndarray) -> tuple[int, int, int] | None:
    """Member i is `buf[pos[i] : pos[i] + nbytes[i]]` (`buf` a 1-D byte memoryview), its CRC32
    should be `expected[i]`. None when every member has it; else (k, the CRC32 member k has, how
    many members differ), k the first that differs.

    Members that follow each other in `buf` with no byte between them are checked as one run: one
    `crc32` call over the run against the members' CRCs combined (`crc32_combine`). Per member,
    `crc32` gives the GIL up and takes it back once per call past 5 KiB, and with other threads
    busy in Python each take-back waits for them: measured on 2 cores at 35 KB per member, that
    cost the loader's R tier a third of its samples/s. A run that differs is checked member by
    member, to name the culprit."""
    if crc32_combine is not None and len(pos) > 1:
        cut = np.flatnonzero(pos[1:] != pos[:-1] + nbytes[:-1]) + 1
        P, N, E = pos.tolist(), nbytes.tolist(), expected.tolist()
        ok = True
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(P)]):
            want = E[a]
            for k in range(a + 1, b):
                want = crc32_combine(want, E[k], N[k])
            if crc32(buf[P[a] : P[b - 1] + N[b - 1]]) != want:
                ok = False
                break
        if ok:
            return None
    got = np.fromiter((crc32(buf[a : a + n]) for a, n in zip(pos.tolist(), nbytes.tolist())),
                      np.int64, len(pos))
    bad = got != expected
    if not bad.any():
        return None
    k = int(np.argmax(bad))
    return k, int(got[k]), int(bad.sum())
