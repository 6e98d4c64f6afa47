"""Columnar inputs: a Parquet file, a folder of them, or a HuggingFace `datasets` folder written by
`save_to_disk` (Arrow IPC streams), converted row by row through the public writer
(`gdsload.convert.writer.write`), so the output is the same for any number of workers.

Columns become fields. `--columns image:jpg,label:cls,caption:txt` names them (a column mapped
to `__key__` gives the sample keys); without it they are detected:

- HuggingFace image and audio structs `{bytes, path}` (from the `datasets` features stored with
  the data, else from the bytes): an image field named by the first image's type (`jpg`, `png`,
  ...), an audio field (`wav`, `flac`, `mp3`, `ogg`);
- integer columns with `ClassLabel` features, or named `label`/`labels`/`class`/`target`: `cls`
  (the `ClassLabel` names become the manifest's `classes`);
- strings: `txt`; lists of numbers (any depth, HuggingFace `Sequence`/`ArrayND`): `npy`;
  binary: by its bytes (an image type, `.npy`, else `bin`); anything else: `json`;
- a field takes the extension alone when one column has it, else `COLUMN.EXT`.

Keys are the row number over all files (`%010d`), or the `__key__` column. Bad input is refused
before anything is written (a column that does not exist, a string column mapped to an image
field, ...). A null in a used column rejects its row, with the reason, into `rejected.jsonl`; an
image struct with only a `path` is read from that path, relative to the Parquet file's folder and
only inside it (an absolute path, a URL, `file://` included, a `..` component or a link on the way
is a rejected row naming the row and the path, as is a file that cannot be read).

Memory: a unit of work is a Parquet row group (or an Arrow file); it is read in batches of about
`batch_nbytes` through a buffered stream (`buffer_size`, no pre-buffering), so a row group larger
than memory is streamed, bounded by the batch and one data page per column. (Arrow IPC record
batches are read whole: `datasets` writes them at 100-1000 rows.) Local paths and fsspec URLs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gdsload.convert.sources import _tree, read_range
from gdsload.errors import InputError, require
from gdsload.format import manifest as mf
from gdsload.io import is_remote, local_path
from gdsload.io.store import url_to_fs

BATCH_NBYTES = 16 << 20  # rows per read: about this many bytes of data
BUFFER_NBYTES = 1 << 20  # the Parquet reader's stream buffer
LABEL_NAMES = frozenset({"label", "labels", "class", "target", "cls"})
_MAGIC = [(b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF8", "gif"), (b"BM", "bmp"),
          (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"\x00\x00\x00\x0cjP  ", "jp2"),
          (b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\xff\xfb", "mp3"), (b"\xff\xf3", "mp3"),
          (b"\x93NUMPY", "npy")]
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")  # file://, s3://, https://, ...
_DRIVE = re.compile(r"^[A-Za-z]:[/\\]")  # C:\, C:/


def sniff(data: bytes | None) -> str | None:
    """The extension the bytes' type has (`jpg`, `png`, `wav`, `npy`, ...), or None."""
    if not data:
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), None)


def _pa() -> Any:
    """pyarrow, with its `parquet` and `ipc` modules loaded (an install hint when missing)."""
    pa = require("pyarrow", extra="columnar", purpose="reading Parquet and Arrow inputs")
    import pyarrow.ipc
    import pyarrow.parquet  # noqa: F401

    return pa


# -- the source ----------------------------------------------------------------------------------
@dataclass
class Columnar:
    """A columnar source: its files, schema, HuggingFace features and units of work."""

    src: str
    kind: str  # "parquet" or "arrow"
    files: list[str]
    stamps: list[str]
    schema: Any  # pyarrow.Schema
    features: dict[str, Any] | None
    units: list[tuple[str, int, str]] = field(default_factory=list)  # (file, row group or -1, stamp)
    unit_rows: list[int] = field(default_factory=list)
    unit_row_nbytes: list[float] = field(default_factory=list)  # mean bytes per row


def is_columnar(src: str) -> str | None:
    """"parquet" or "arrow" when `src` is a columnar source, else None."""
    if src.endswith((".parquet", ".pq")):
        return "parquet"
    tree = _tree(src)
    root = tree.norm(src)
    if tree.kind(root) != "dir":
        return None
    children = tree.children(root)
    names = {n for n, _, _ in children}
    if "dataset_dict.json" in names or ("state.json" in names and any(n.endswith(".arrow") for n in names)):
        return "arrow"
    # Parquet files at the top, or in `data/` (the HuggingFace hub's layout); not a walk of the
    # whole tree, which for an image folder would list every image twice
    if any(n.endswith((".parquet", ".pq")) for n, is_dir, _ in children if not is_dir):
        return "parquet"
    if any(n == "data" and is_dir for n, is_dir, _ in children) and \
            any(n.endswith((".parquet", ".pq")) for n, _, _ in tree.children(tree.join(root, "data"))):
        return "parquet"
    return None


def _open(path: str) -> Any:
    """A file for Arrow: fsspec's for a URL; Arrow's own for a local path (its reads run in C++
    without the GIL and fill Arrow's buffers directly; a Python file object costs a GIL round trip
    and a bytes copy per read, which was most of the writer's Parquet time)."""
    if is_remote(path):
        fs, p = url_to_fs(path)
        return fs.open(p, "rb")
    return _pa().OSFile(str(local_path(path)), "r")


def _features(metadata: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    """The `datasets` features stored in a schema's metadata (`huggingface` key), if any."""
    raw = (metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        return json.loads(raw).get("info", {}).get("features")
    except (ValueError, AttributeError):
        return None


def open_columnar(src: str, kind: str | None = None) -> Columnar:
    """List a columnar source without reading its data (Parquet footers, Arrow schemas)."""
    pa = _pa()
    kind = kind or is_columnar(src)
    tree = _tree(src)
    root = tree.norm(src)
    if kind is None:
        raise InputError(f"{src}: not a Parquet file, a folder of Parquet files, or a datasets save_to_disk folder")
    features = None
    if kind == "arrow":
        files_in = tree.files_in(root)
        if "dataset_dict.json" in files_in:
            splits = json.loads(read_range(files_in["dataset_dict.json"].path)).get("splits", [])
            raise InputError(f"{src} holds a DatasetDict with splits {splits}: convert one split's folder, "
                             f"e.g. {tree.join(root, splits[0]) if splits else src + '/train'}")
        state = json.loads(read_range(files_in["state.json"].path))
        names = [d["filename"] for d in state.get("_data_files", [])]
        missing = [n for n in names if n not in files_in]
        if not names or missing:
            raise InputError(f"{src}: state.json lists data files {names} but {missing or 'none'} are there")
        listed = [files_in[n] for n in names]
        if "dataset_info.json" in files_in:
            features = json.loads(read_range(files_in["dataset_info.json"].path)).get("features")
    elif tree.kind(root) == "dir":
        listed = [f for f in tree.walk(root) if f.rel.endswith((".parquet", ".pq"))]
    else:
        f = tree.stat(root)
        listed = [f]
    bad = [f for f in listed if isinstance(f.size, str)]
    if bad:
        raise InputError(f"{bad[0].path}: {bad[0].size}")
    if not listed:
        raise InputError(f"{src}: no Parquet files")
    out = Columnar(src, kind, [f.path for f in listed], [f.stamp for f in listed], None, features)
    for f in listed:
        try:
            with _open(f.path) as fh:
                if kind == "parquet":
                    pf = pa.parquet.ParquetFile(fh)
                    schema = pf.schema_arrow
                    for g in range(pf.metadata.num_row_groups):
                        rg = pf.metadata.row_group(g)
                        if rg.num_rows:
                            out.units.append((f.path, g, f.stamp))
                            out.unit_rows.append(rg.num_rows)
                            out.unit_row_nbytes.append(rg.total_byte_size / rg.num_rows)
                else:  # rows counted once, for the keys (a memory map locally: headers only)
                    reader = pa.ipc.open_stream(pa.memory_map(f.path) if not is_remote(f.path) else fh)
                    schema = reader.schema
                    rows = sum(b.num_rows for b in reader)
                    out.units.append((f.path, -1, f.stamp))
                    out.unit_rows.append(rows)
                    out.unit_row_nbytes.append(0.0)
        except (OSError, pa.ArrowInvalid) as exc:
            raise InputError(f"{f.path}: not a readable {'Parquet' if kind == 'parquet' else 'Arrow'} file ({exc})") from exc
        schema = schema.remove_metadata() if out.schema is not None else schema
        if out.schema is None:
            out.features = out.features or _features(schema.metadata)
            out.schema = schema.remove_metadata()
        elif not schema.equals(out.schema):
            raise InputError(f"{f.path}: its columns differ from {out.files[0]}'s ({schema} vs {out.schema}); "
                             f"convert files with one schema together")
    return out


# -- columns -> fields ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    name: str  # the Arrow column
    field: str  # the gdsload field (extension), or "__key__"
    how: str  # media (a {bytes, path} struct), binary, text, label, npy, json, key
    dtype: str | None = None  # npy: the NumPy dtype of the list's values


def _is_media_struct(t: Any) -> bool:
    pa = _pa()
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0 and \
        (pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type))


def _list_value_type(t: Any) -> Any | None:
    """The numeric value type of a (nested) list type, or None."""
    pa = _pa()
    is_list = lambda t: pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not is_list(t):
        return None
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return t
    return None


def _type_name(t: Any) -> str:
    return "an image struct {bytes, path}" if _is_media_struct(t) else str(t)


def _sanitize(name: str) -> str:
    return re.sub(r"[\s./]", "_", name) or "_"


def _sample_bytes(src: Columnar, column: str) -> bytes | None:
    """The first non-null bytes of a binary or media column (to name its type)."""
    pa = _pa()
    for unit in src.units[:4]:
        for batch in _batches(src, unit, [column], 64 << 10):
            col = batch.column(0)
            if pa.types.is_struct(col.type):
                col = col.flatten()[col.type.get_field_index("bytes")]
            for v in col.to_pylist():
                if v:
                    return v
    return None


def plan_columns(src: Columnar, spec: str | None) -> tuple[list[Column], list[str] | None]:
    """The columns to convert and how, and the class names (of the `cls` field's `ClassLabel`)."""
    schema, feats = src.schema, src.features or {}
    names = list(schema.names)
    wanted: list[tuple[str, str | None]]
    if spec:
        wanted = []
        for part in spec.split(","):
            col, sep, ext = part.strip().partition(":")
            if not col or not sep or not ext:
                raise InputError(f"--columns: {part.strip()!r} is not COLUMN:FIELD (e.g. image:jpg,label:cls)")
            if col not in names:
                raise InputError(f"--columns: column {col!r} does not exist in {src.src}; its columns are "
                                 f"{', '.join(names)}")
            wanted.append((col, ext))
    else:
        wanted = [(n, None) for n in names]
    planned: list[Column] = []
    label_names: dict[str, list[str]] = {}  # column -> its ClassLabel names
    for col, ext in wanted:
        t = schema.field(col).type
        feat = feats.get(col) or {}
        ftype = feat.get("_type") if isinstance(feat, dict) else None
        c = _plan_one(src, col, ext, t, ftype)
        if c is None:
            continue
        if c.how == "label" and ftype == "ClassLabel" and feat.get("names"):
            label_names[col] = list(feat["names"])
        planned.append(c)
    if not spec:  # name fields: the extension alone where one column has it
        counts: dict[str, int] = {}
        for c in planned:
            counts[c.field] = counts.get(c.field, 0) + 1
        planned = [c if c.field == "__key__" or counts[c.field] == 1 or c.name in LABEL_NAMES and c.field == "cls"
                   else Column(c.name, f"{_sanitize(c.name)}.{c.field}", c.how, c.dtype) for c in planned]
        seen: dict[str, str] = {}
        for c in planned:
            if c.field in seen:
                raise InputError(f"columns {seen[c.field]!r} and {c.name!r} would both become field {c.field!r}; "
                                 f"name the fields with --columns")
            seen[c.field] = c.name
    keys = [c for c in planned if c.how == "key"]
    if len(keys) > 1:
        raise InputError(f"--columns: more than one key column ({', '.join(c.name for c in keys)})")
    if len(planned) == len(keys):
        raise InputError(f"{src.src}: no column to convert (columns: {', '.join(names)})")
    fields = [c.field for c in planned if c.how != "key"]
    dup = {f for f in fields if fields.count(f) > 1}
    if dup:
        raise InputError(f"--columns: field {sorted(dup)[0]!r} is given to more than one column")
    named = [c for c in planned if c.name in label_names]
    main = next((c for c in named if c.field == "cls"), named[0] if named else None)
    return planned, (label_names[main.name] if main is not None else None)


def _plan_one(src: Columnar, col: str, ext: str | None, t: Any, ftype: str | None) -> Column | None:
    pa = _pa()
    where = f"column {col!r} ({_type_name(t)})"
    if ext == "__key__" or (ext is None and col == "__key__"):
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)):
            raise InputError(f"{where} cannot give sample keys: a key column holds strings or integers")
        return Column(col, "__key__", "key")
    media = _is_media_struct(t)
    binary = pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
    text = pa.types.is_string(t) or pa.types.is_large_string(t)
    values = _list_value_type(t) if not media else None
    if ext is None:  # detection
        if pa.types.is_null(t):
            return None
        if media or binary:
            found = sniff(_sample_bytes(src, col))
            if found is None:
                found = {"Image": "jpg", "Audio": "wav"}.get(ftype or "", "bin")
            return Column(col, found, "media" if media else "binary")
        if text:
            return Column(col, "txt", "text")
        if pa.types.is_integer(t) and (ftype == "ClassLabel" or col.lower() in LABEL_NAMES):
            return Column(col, "cls", "label")
        if values is not None and not pa.types.is_boolean(values):
            return Column(col, "npy", "npy", np.dtype(values.to_pandas_dtype()).str)
        return Column(col, "json", "json")
    if ext.startswith("__") or "/" in ext or any(ch.isspace() for ch in ext):
        raise InputError(f"--columns: {ext!r} is not a field name (an extension such as jpg, cls, caption.txt)")
    kind = mf.field_kind(ext)
    if kind == "image" or (kind == "bytes" and not text):
        if not (media or binary):
            raise InputError(f"--columns {col}:{ext}: {where} is not bytes; a{'n image' if kind == 'image' else ''} "
                             f"{ext} field needs a binary column or an image struct {{bytes, path}}")
        return Column(col, ext, "media" if media else "binary")
    if kind == "label":
        if not pa.types.is_integer(t):
            raise InputError(f"--columns {col}:{ext}: {where} is not an integer column; a label field needs integers")
        return Column(col, ext, "label")
    if kind == "text":
        if not (text or binary):
            raise InputError(f"--columns {col}:{ext}: {where} is not a string column; a text field needs strings")
        return Column(col, ext, "text" if text else "binary")
    if kind == "tensor":
        if binary:
            return Column(col, ext, "binary")
        if values is None or pa.types.is_boolean(values):
            raise InputError(f"--columns {col}:{ext}: {where} is not a list of numbers (or .npy bytes)")
        return Column(col, ext, "npy", np.dtype(values.to_pandas_dtype()).str)
    return Column(col, ext, "json" if kind == "json" else ("text" if text else "json"))


# -- reading -------------------------------------------------------------------------------------
def _batches(src: Columnar, unit: tuple[str, int, str], columns: list[str],
             batch_nbytes: int) -> Iterator[Any]:
    pa = _pa()
    path, group, _ = unit
    with _open(path) as fh:
        if group >= 0:
            pf = pa.parquet.ParquetFile(fh, buffer_size=BUFFER_NBYTES, pre_buffer=False)
            rg = pf.metadata.row_group(group)
            rows = max(1, min(rg.num_rows, int(batch_nbytes // max(1.0, rg.total_byte_size / max(1, rg.num_rows)))))
            yield from pf.iter_batches(batch_size=rows, row_groups=[group], columns=columns, use_threads=False)
        else:
            source = pa.memory_map(path) if not is_remote(path) else fh
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                yield batch.select(columns)


class Rows:
    """`fn` for `write`: one unit (a row group or an Arrow file) -> its rows as samples."""

    def __init__(self, src: Columnar, columns: list[Column], batch_nbytes: int = BATCH_NBYTES):
        self.src, self.columns, self.batch_nbytes = src, columns, batch_nbytes
        self.first_row = {}  # unit -> global number of its first row (for keys)
        n = 0
        for unit, rows in zip(src.units, src.unit_rows):
            self.first_row[unit] = n
            n += rows

    def __repr__(self) -> str:  # what `write`'s resume fingerprint sees
        return f"columnar.Rows({[(c.name, c.field, c.how) for c in self.columns]})"

    def __call__(self, unit: tuple[str, int, str]) -> Iterator[dict[str, Any]]:
        row = self.first_row[unit]
        names = [c.name for c in self.columns]
        folder = unit[0].rsplit("/", 1)[0] if "/" in unit[0] else "."
        key_col = next((c for c in self.columns if c.how == "key"), None)
        for batch in _batches(self.src, unit, names, self.batch_nbytes):
            cols = {c.name: batch.column(i) for i, c in enumerate(self.columns)}
            values = {}
            for c in self.columns:
                a = cols[c.name]
                if c.how == "media":
                    children = a.flatten()  # offsets and the struct's nulls applied
                    paths = children[a.type.get_field_index("path")].to_pylist() \
                        if a.type.get_field_index("path") >= 0 else [None] * len(a)
                    values[c.name] = list(zip(binary_views(children[a.type.get_field_index("bytes")]), paths,
                                              a.is_null().to_pylist()))
                elif c.how == "binary":
                    values[c.name] = binary_views(a)
                else:
                    values[c.name] = a.to_pylist()
            for r in range(batch.num_rows):
                key = f"{row + r:010d}" if key_col is None else str(values[key_col.name][r])
                sample: dict[str, Any] = {"__key__": key}
                problem = None
                for c in self.columns:
                    if c.how == "key":
                        continue
                    v = values[c.name][r]
                    if c.how == "media":
                        data, path, null = v
                        if null or (data is None and not path):
                            problem = f"column {c.name!r} is null in row {row + r}"
                        elif data is None:
                            data, problem = _read_path(folder, path, c.name, row + r)
                        v = data
                    elif v is None:
                        problem = f"column {c.name!r} is null in row {row + r}"
                    elif c.how == "npy":
                        v, problem = _as_array(v, c, row + r)
                    elif c.how == "json":
                        v = json.dumps(v, ensure_ascii=False, default=str)
                    if problem:
                        break
                    sample[c.field] = v
                if problem:
                    yield {"__key__": key, "__reject__": problem}
                    continue
                yield sample
            row += batch.num_rows


def _as_array(value: Any, c: Column, row: int) -> tuple[Any, str | None]:
    """A list value of an `npy` column as an array of the column's dtype, or (None, the reason)
    when it is not one: ragged (`[[1, 2], [3]]`) or holding a null, which NumPy refuses with a
    message that names neither the row nor the column."""
    try:
        arr = np.asarray(value, dtype=c.dtype)
    except (ValueError, TypeError) as exc:
        return None, f"column {c.name!r} in row {row} is not a rectangular list of numbers " \
                     f"(ragged, or a null inside): {str(exc).partition('.')[0]}"
    return arr, None


def binary_views(a: Any) -> list[memoryview | bytes | None]:
    """The values of a binary Arrow array as memoryviews of its data buffer (no copies; None
    for nulls). They keep the batch's buffer alive until written."""
    pa = _pa()
    if not (pa.types.is_binary(a.type) or pa.types.is_large_binary(a.type)):
        return a.to_pylist()
    _, offsets, data = a.buffers()[:3]
    offs = np.frombuffer(offsets, np.int64 if pa.types.is_large_binary(a.type) else np.int32)
    offs = offs[a.offset: a.offset + len(a) + 1].tolist()
    view = memoryview(data) if data is not None else memoryview(b"")
    if not a.null_count:
        return [view[lo:hi] for lo, hi in zip(offs, offs[1:])]
    nulls = a.is_null().to_pylist()
    return [None if nulls[k] else view[offs[k]:offs[k + 1]] for k in range(len(a))]


def _read_path(folder: str, path: str, column: str, row: int) -> tuple[bytes | None, str | None]:
    """An image struct with a path but no bytes: the file at that path, relative to the Parquet
    (or Arrow) file's folder and inside it, as tar members are inside their tar: an absolute path,
    a URL (`file://` too), a `..` component or a symbolic link on the way (links inside the input
    are not followed) is refused, and so is a file that cannot be read. Refused: (None, the reason,
    naming the column, the row and the path)."""
    where = f"column {column!r} in row {row} has no bytes and its path {path!r}"
    parts = path.replace("\\", "/").split("/")
    if "\x00" in path:
        return None, f"{where} holds a NUL byte"
    if _URL.match(path):
        return None, f"{where} is a URL; a path in an image struct is relative to the Parquet file's folder"
    if path.startswith(("/", "\\")) or _DRIVE.match(path):
        return None, f"{where} is absolute; a path in an image struct is relative to the Parquet file's folder"
    if ".." in parts:
        return None, f"{where} leaves the Parquet file's folder with '..'"
    try:
        if is_remote(folder):  # an object store: no links, and `..` is refused above
            return read_range(f"{folder}/{path}"), None
        base = os.path.realpath(local_path(folder))
        full = os.path.normpath(os.path.join(base, path))
        real = os.path.realpath(full)
        if real != full:  # a link on the way: its target is not followed, inside the folder or not
            return None, f"{where} goes through a symbolic link (to {real!r}); links inside the input are not followed"
        return read_range(full), None  # O_NOFOLLOW: a file swapped for a link since is not followed either
    except OSError as exc:
        return None, f"{where} cannot be read ({exc.strerror or exc})"
