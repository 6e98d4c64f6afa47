"""What each field of a sample becomes in a batch, by its extension.

| field                     | in a batch (dict of columns)                       | in a sample given to `map` |
|---------------------------|----------------------------------------------------|----------------------------|
| image (`jpg`, `depth.png`)| one decoded tensor (N, ...) per image field        | NumPy array (one image)    |
| `.npy`, one shape         | one tensor (N, *shape), read into the ring         | NumPy array                |
| `.npy`, shapes vary       | a list of N tensors ("ragged")                     | NumPy array                |
| `.cls`                    | int64 tensor (N,)                                  | `numpy.int64`              |
| `.txt`                    | list of `str` (UTF-8)                              | `str`                      |
| `.json`                   | list of parsed objects (`json.loads`)              | dict / list / ...          |
| video (`mp4`, `webm`, ...) | with a `VideoTransform`: clips (N, [clips,] C, T, H, W) and `"<f>.frames"`; else bytes | NumPy arrays |
| audio (`flac`, `wav`, ...) | with an `AudioTransform`: (N, samples) or log-mel, and `"<f>.length"`; else bytes | NumPy arrays |
| anything else             | `BytesColumn` (a sequence of `bytes`, see below)   | `bytes`                    |

With `decode=False`, images, `.txt` and `.json` stay `bytes`. A `.npy` field is "ragged" when its
members' payload sizes differ in the shard indexes (an array-level check, no read); ragged
members are read whole into the staging buffer and parsed per sample (a Python step and a copy
per sample, unlike the zero-copy fixed-shape path). `.txt`, `.json` and ragged values are parsed
per sample in the producer threads; a value that does not parse raises `DecodeError` naming shard
and key (`on_error="skip"` applies to images only).

A bytes column (`BytesColumn`) is one object per batch, not one `bytes` per sample: item i is
made when it is asked for, `view(i)` is a zero-copy NumPy view, and `data`/`offsets`/`sizes` give
the whole column as arrays. It owns its buffer (unlike the batch tensors it never points into the
ring), so it may be kept. A loader that decodes nothing reads the members straight into that
buffer (one copy, kernel to column); one that also decodes images stages them in the ring and
copies the bytes fields out once per batch.

The remote feed carries these fields as bytes items (`to_wire`); the client parses them with the
same function (`parse`), so local and remote batches are equal.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gdsload.errors import FormatError
from gdsload.format import npy
from gdsload.format.manifest import field_kind

#: kinds whose batch column holds per-sample values (a `BytesColumn` or a list), not one tensor
LIST_KINDS = frozenset({"bytes", "text", "json", "ragged"})


class BytesColumn(Sequence):
    """A batch's bytes field: `column[i]` is sample i's member as `bytes`, made when asked.

    `data` is a uint8 buffer the column owns (the loader reads a batch's members straight into
    it, or copies them there once), member i is `data[offsets[i] : offsets[i] + sizes[i]]`; so a
    column stays valid after the loader moves on, like a list of bytes, at one object per batch.
    Equal to any sequence of the same bytes (`column == [b"...", ...]`).
    """

    __slots__ = ("data", "offsets", "sizes")

    def __init__(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
        self.data, self.offsets, self.sizes = data, offsets, sizes

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        """The members' bytes, all together."""
        return int(np.sum(self.sizes))

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        a = int(self.offsets[i])
        return self.data[a : a + int(self.sizes[i])].tobytes()

    def view(self, i: int) -> np.ndarray:
        """Member i as a zero-copy uint8 view."""
        a = int(self.offsets[i])
        return self.data[a : a + int(self.sizes[i])]

    def take(self, rows: Sequence[int] | np.ndarray) -> "BytesColumn":
        """The members `rows`, in that order (no bytes copied)."""
        rows = np.asarray(rows, np.intp)
        return BytesColumn(self.data, self.offsets[rows], self.sizes[rows])

    def copy(self) -> "BytesColumn":
        """The same members packed into a buffer of their own (one copy): what the loader keeps
        when the members were staged in its ring."""
        sizes = np.asarray(self.sizes, np.int64)
        offsets = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        data = np.empty(int(sizes.sum()), np.uint8)
        for a, o, n in zip(self.offsets.tolist(), offsets.tolist(), sizes.tolist()):
            data[o : o + n] = self.data[a : a + n]
        return BytesColumn(data, offsets, sizes)

    def tolist(self) -> list[bytes]:
        data = self.data
        return [data[a : a + n].tobytes() for a, n in zip(self.offsets.tolist(), self.sizes.tolist())]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BytesColumn, list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):  # pickled packed: only its own members travel
        c = self.copy()
        return BytesColumn, (c.data, c.offsets, c.sizes)

    def __repr__(self) -> str:
        return f"BytesColumn({len(self)} members, {self.nbytes} bytes)"


def loader_kind(name: str, *, decode: bool) -> str:
    """The kind a loader gives field `name`: image, tensor, label, text, json or bytes (a tensor
    field becomes "ragged" later, once `is_ragged` has seen the index)."""
    kind = field_kind(name)
    if not decode and kind in ("image", "text", "json"):
        return "bytes"
    return kind if kind in ("image", "tensor", "label", "text", "json") else "bytes"


def is_ragged(ds: Any, name: str) -> bool:
    """Whether the `.npy` field `name` of a `ShardedDataset` has members of different sizes
    (so no one batch tensor can hold them). Uses the index columns only."""
    lo = hi = None
    for s in range(len(ds.shards)):
        entry = ds.shards[s]
        if "min_nbytes" in entry and "max_nbytes" in entry:  # the manifest says: no index to load
            if name in entry["max_nbytes"]:
                a, b = entry["min_nbytes"][name], entry["max_nbytes"][name]
                lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
            continue
        idx = ds.index(s)
        if name not in idx.extensions:
            continue
        sizes = idx.member_size[idx.member_ext == idx.extensions.index(name)]
        if len(sizes):
            a, b = int(sizes.min()), int(sizes.max())
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return lo is not None and lo != hi


def parse(kind: str, raw: Any, where: str) -> Any:
    """One member's bytes (`raw`: bytes-like) as the value of its kind; `where` ("shard:key")
    names it in errors."""
    from gdsload.decode.image import DecodeError

    try:
        if kind == "text":
            return bytes(raw).decode("utf-8")
        if kind == "json":
            return json.loads(bytes(raw))
        if kind == "ragged":
            data = bytes(raw)
            dtype, shape, fortran, off = npy.parse_header(data[: min(len(data), 2 * 4096)])
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(data, dtype=dtype, count=count, offset=off)
            return arr.reshape(shape, order="F" if fortran else "C").copy()
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, FormatError) as exc:
        raise DecodeError(f"cannot parse the {kind} field of {where}: {exc}") from exc
    return bytes(raw)


def to_wire(value: Any) -> bytes | memoryview:
    """A list item of a batch column as bytes for the feed: str as UTF-8, an array as npy bytes,
    a parsed JSON value as JSON text; bytes as they are."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def parse_columns(batch: dict[str, Any], *, decode: bool) -> dict[str, Any]:
    """A batch from the feed, its bytes columns parsed as `loader_kind` says (in place)."""
    for name, col in batch.items():
        if name.startswith("__") or not isinstance(col, (list, BytesColumn)):
            continue
        kind = loader_kind(name, decode=decode)
        kind = "ragged" if kind == "tensor" else kind  # a tensor field sent as items is ragged
        if kind in ("text", "json", "ragged"):
            batch[name] = [parse(kind, v, f"field {name!r}, item {i}") for i, v in enumerate(col)]
    return batch
