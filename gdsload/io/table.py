"""Read requests as arrays: `ExtentTable`, coalesced with array operations.

`Backend.read` takes one `Extent` object per range, which costs Python objects (and validation)
per member; a loader batch of 256 samples is thousands of them. An `ExtentTable` is the same
request as four int64 columns (file number, file offset, size, destination offset) plus the tuple
of paths the file numbers refer to, so planning, validating and coalescing a batch is a few NumPy
calls whatever its size. The contract is `Backend.read`'s: exactly the bytes
`[offset, offset + nbytes)` of each row's file land at `out[out_offset : out_offset + nbytes]`,
and no other byte of `out` is touched.

`read_table(backend, table, out)` uses the backend's own `read_table` where it has one (POSIX:
one `preadv` per coalesced group, in the calling thread) and otherwise builds `Extent`s for its
`read` (KvikIO, fsspec), so every backend takes a table.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gdsload.errors import GdsloadError
from gdsload.io.base import Extent


@dataclass(frozen=True, slots=True)
class ExtentTable:
    """Row i: `nbytes[i]` bytes of `paths[file[i]]` from `offset[i]`, to `out[out_offset[i]:]`."""

    paths: tuple[str, ...]
    file: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    out_offset: np.ndarray

    def __len__(self) -> int:
        return len(self.file)

    @classmethod
    def concat(cls, paths: tuple[str, ...], parts: list[tuple[np.ndarray, ...]]) -> "ExtentTable":
        """One table from `(file, offset, nbytes, out_offset)` column groups over `paths`."""
        if not parts:
            empty = np.zeros(0, np.int64)
            return cls(paths, empty, empty, empty, empty)
        cols = [np.concatenate([np.asarray(p[k], np.int64) for p in parts]) for k in range(4)]
        return cls(paths, *cols)

    def extents(self) -> tuple[list[Extent], list[int]]:
        """The same request as `Extent`s and out offsets, for `Backend.read`."""
        paths = self.paths
        ex = [Extent(paths[f], o, n) for f, o, n in zip(self.file.tolist(), self.offset.tolist(),
                                                         self.nbytes.tolist())]
        return ex, self.out_offset.tolist()


def check_table(table: ExtentTable, out: Any) -> None:
    """`check_request` for a table: two vectorised bounds checks instead of one per extent."""
    n = len(table)
    if any(len(c) != n for c in (table.offset, table.nbytes, table.out_offset)):
        raise GdsloadError("extent table columns differ in length")
    if not n:
        return
    size = int(out.shape[0])
    if table.file.min() < 0 or table.file.max() >= len(table.paths):
        raise GdsloadError(f"extent table names files outside its {len(table.paths)} paths")
    bad = (table.offset < 0) | (table.nbytes < 0) | (table.out_offset < 0) | (table.out_offset + table.nbytes > size)
    if bad.any():
        i = int(np.argmax(bad))
        raise GdsloadError(
            f"out_offset={int(table.out_offset[i])} with nbytes={int(table.nbytes[i])} (from "
            f"{table.paths[int(table.file[i])]!r}@{int(table.offset[i])}) does not fit in out of {size} "
            f"bytes, or is negative"
        )


def group_table(table: ExtentTable, *, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort the non-empty rows by (file, offset) and cut them into read groups.

    Returns `(order, starts)`: `order` the row numbers in read order, `starts` the positions in
    `order` where a group begins (plus `len(order)` at the end). A row joins the group before it
    when it is in the same file and starts at most `max_gap` bytes after the previous row ends
    (overlapping rows start a new group), as `coalesce` does for `Extent`s.
    """
    rows = np.flatnonzero(table.nbytes > 0)
    order = rows[np.lexsort((table.offset[rows], table.file[rows]))]
    f, o = table.file[order], table.offset[order]
    end = o + table.nbytes[order]
    gap = o[1:] - end[:-1]
    joins = (f[1:] == f[:-1]) & (gap >= 0) & (gap <= max_gap)
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1, [len(order)])) if len(order) else np.zeros(1, np.int64)
    return order, starts


def read_table(backend: Any, table: ExtentTable, out: Any) -> Future[int]:
    """Read `table` into `out` with `backend`; a future of the payload bytes delivered."""
    return backend.read_table(table, out)
