"""What each field of a sample becomes in a batch, by its extension.

| field                     | in a batch (dict of columns)                       | in a sample given to `map` |
|---------------------------|----------------------------------------------------|----------------------------|
| image (`jpg`, `depth.png`)| one decoded tensor (N, ...) per image field        | NumPy array (one image)    |
| `.npy`, one shape         | one tensor (N, *shape), read into the ring         | NumPy array                |
| `.npy`, shapes vary       | a list of N tensors ("ragged")                     | NumPy array                |
| `.cls`                    | int64 tensor (N,)                                  | `numpy.int64`              |
| `.txt`                    | list of `str` (UTF-8)                              | `str`                      |
| `.json`                   | list of parsed objects (`json.loads`)              | dict / list / ...          |
| anything else             | list of `bytes`                                    | `bytes`                    |

With `decode=False`, images, `.txt` and `.json` stay `bytes`. A `.npy` field is "ragged" when its
members' payload sizes differ in the shard indexes (an array-level check, no read); ragged
members are read whole into the staging buffer and parsed per sample (a Python step and a copy
per sample, unlike the zero-copy fixed-shape path). `.txt`, `.json` and ragged values are parsed
per sample in the producer threads; a value that does not parse raises `DecodeError` naming shard
and key (`on_error="skip"` applies to images only).

The remote feed carries these fields as bytes items (`to_wire`); the client parses them with the
same function (`parse`), so local and remote batches are equal.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from gdsload.errors import FormatError
from gdsload.format import npy
from gdsload.format.manifest import field_kind

#: kinds whose batch column is a Python list (per-sample values), not one batch tensor
LIST_KINDS = frozenset({"bytes", "text", "json", "ragged"})


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
        if name.startswith("__") or not isinstance(col, list):
            continue
        kind = loader_kind(name, decode=decode)
        kind = "ragged" if kind == "tensor" else kind  # a tensor field sent as items is ragged
        if kind in ("text", "json", "ragged"):
            batch[name] = [parse(kind, v, f"field {name!r}, item {i}") for i, v in enumerate(col)]
    return batch
