"""Conversion inputs: find the samples of an image folder, a `KEY.EXT` folder, WebDataset tars or
an `.npy` folder, without reading payloads.

A source is listed into `Sample`s: a key and, per field, a `Ref` saying where the bytes are (a
file, a byte range of an input tar, or inline bytes for labels) and how many bytes the field will
take in a shard. Listing is cheap (stat and tar headers only) and deterministic: sorted by path.

Per-file problems that lose one sample (an empty file, a non-image file in an image folder, an
invalid `.npy`) become rejects with a reason. Problems that make the input untrustworthy or
ambiguous (path traversal, links or devices in a tar, an oversized PAX header, a truncated tar,
duplicate keys, a missing path) raise `InputError` naming the file and member.

Key rules (webdataset splits member names at the first dot of the base name, DALI's index is
whitespace-separated): keys made from file names have dots and whitespace replaced by `_`; keys
read from tars must already be valid. Two inputs that map to the same key are an error naming both.
Hidden files (name starting with `.`) are ignored.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gdsload.errors import FormatError, InputError
from gdsload.format import npy
from gdsload.format.index import check_key, split_name
from gdsload.format.manifest import IMAGE_EXTS
from gdsload.format.tar import ALIGN

SourceFormat = Literal["imagefolder", "files", "tar", "npy"]

MAX_PAX_NBYTES = 1 << 20  # a PAX or GNU long-name header bigger than this is refused as hostile


@dataclass(frozen=True)
class Ref:
    """Where a field's bytes come from: a whole file, a byte range of a tar, or inline bytes."""

    path: str | None
    offset: int = 0
    size: int = -1  # -1: the whole file
    data: bytes | None = None
    npy_realign: bool = False  # the payload is an .npy whose data will be moved to 4 KiB
    shard_nbytes: int = 0  # bytes this field takes in a shard (payload, after realignment)


@dataclass(frozen=True)
class Sample:
    key: str
    fields: tuple[tuple[str, Ref], ...]

    @property
    def source(self) -> str:
        return next((r.path for _, r in self.fields if r.path), "<inline>")


@dataclass
class Listing:
    format: SourceFormat
    samples: list[Sample]
    rejects: list[dict[str, str]] = field(default_factory=list)
    classes: list[str] | None = None
    inputs: list[str] = field(default_factory=list)  # files read, for the resume fingerprint


_SANITIZE = re.compile(r"[\s.]")


def _key_from_path(rel: str) -> str:
    return "/".join(_SANITIZE.sub("_", part) for part in rel.split("/"))


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _walk(root: Path) -> list[Path]:
    """Regular files (and links to them) under root, sorted, hidden ones skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if _visible(d))
        out += [Path(dirpath) / f for f in sorted(filenames) if _visible(f)]
    return out


def _file_ref(path: Path, size: int) -> Ref:
    return Ref(str(path), 0, size, shard_nbytes=size)


def _label_ref(label: int) -> Ref:
    data = str(label).encode()
    return Ref(None, data=data, size=len(data), shard_nbytes=len(data))


class _KeyRegistry:
    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def add(self, key: str, where: str) -> None:
        try:
            check_key(key)
        except FormatError as exc:
            raise InputError(f"{where}: {exc}") from None
        other = self.seen.setdefault(key, where)
        if other != where:
            raise InputError(f"duplicate sample key {key!r}: {other} and {where}")


def _stat_size(path: Path) -> int | str:
    """File size, or the reason it cannot be read."""
    try:
        st = path.stat()
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if not os.access(path, os.R_OK):
        return "unreadable: permission denied"
    return st.st_size


# -- image folder --------------------------------------------------------------------------------
def list_imagefolder(root: Path) -> Listing:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and _visible(d.name))
    if not classes:
        raise InputError(f"{root}: no class sub-folders found (expected ROOT/CLASS/IMAGE.jpg)")
    listing = Listing("imagefolder", [], classes=classes)
    keys = _KeyRegistry()
    for label, cls in enumerate(classes):
        for path in _walk(root / cls):
            rel = path.relative_to(root).as_posix()
            # the image type is the last suffix: "img.001.jpg" is image "img.001" of type jpg
            stem, dot, ext = rel.rpartition(".")
            if not dot or "/" in ext:
                stem, ext = rel, ""
            ext = ext.lower()
            reject = None
            if ext.rsplit(".", 1)[-1] not in IMAGE_EXTS:
                reject = f"not an image file (extension {ext!r})" if ext else "not an image file (no extension)"
                ext = ext or "bin"
            size = _stat_size(path)
            if isinstance(size, str):
                reject = size
            elif size == 0:
                reject = "empty file (0 bytes)"
            key = _key_from_path(stem)
            if reject:
                listing.rejects.append({"source": str(path), "key": key, "reason": reject})
                continue
            keys.add(key, str(path))
            ext = "jpg" if ext == "jpeg" else ext
            listing.inputs.append(str(path))
            listing.samples.append(Sample(key, ((ext, _file_ref(path, size)), ("cls", _label_ref(label)))))
    return listing


# -- KEY.EXT folder ------------------------------------------------------------------------------
def list_files(root: Path) -> Listing:
    listing = Listing("files", [])
    groups: dict[str, list[tuple[str, Path, int]]] = {}
    owner: dict[tuple[str, str], Path] = {}
    for path in _walk(root):
        stem, ext = split_name(path.relative_to(root).as_posix())
        key = _key_from_path(stem)
        size = _stat_size(path)
        if isinstance(size, str):
            listing.rejects.append({"source": str(path), "key": key, "reason": size})
            continue
        if not ext:
            listing.rejects.append({"source": str(path), "key": key, "reason": "no extension, so no field name"})
            continue
        other = owner.setdefault((key, ext.lower()), path)
        if other != path:
            raise InputError(f"duplicate field {key}.{ext.lower()}: {other} and {path}")
        groups.setdefault(key, []).append((ext.lower(), path, size))
    keys = _KeyRegistry()
    for key in sorted(groups):
        members = sorted(groups[key])
        keys.add(key, str(members[0][1]))
        fields = []
        for ext, path, size in members:
            ref = _npy_ref(path, size) if ext == "npy" else _file_ref(path, size)
            if isinstance(ref, str):
                listing.rejects.append({"source": str(path), "key": key, "reason": ref})
                break
            fields.append((ext, ref))
            listing.inputs.append(str(path))
        else:
            listing.samples.append(Sample(key, tuple(fields)))
    if not listing.samples and not listing.rejects:
        raise InputError(f"{root}: no files found")
    return listing


# -- .npy folder ---------------------------------------------------------------------------------
def _npy_ref(path: Path, size: int, offset: int = 0) -> Ref | str:
    """A Ref for an .npy payload with its shard size after realignment, or a reject reason."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            head = f.read(min(size, 1 << 16))
        dtype, shape, _, data_off = npy.parse_header(head)
    except (FormatError, OSError) as exc:
        return f"not a valid .npy file: {exc}"
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if data_off + nbytes != size:
        return f"truncated .npy: {size} bytes, its header needs {data_off + nbytes}"
    realign = size >= ALIGN and data_off != ALIGN
    return Ref(str(path), offset, size, npy_realign=realign, shard_nbytes=ALIGN + nbytes if realign else size)


def _read_labels(path: Path) -> dict[str, str]:
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise InputError(f"{path}: expected a JSON object mapping key to label")
            return {str(k): str(v) for k, v in data.items()}
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read labels file {path}: {exc}") from exc
    if rows and [c.strip().lower() for c in rows[0][:2]] == ["key", "label"]:
        rows = rows[1:]
    out = {}
    for n, row in enumerate(rows, 2):
        if len(row) < 2:
            raise InputError(f"{path}:{n}: expected 'key,label', got {row!r}")
        out[row[0].strip()] = row[1].strip()
    return out


def list_npy(root: Path, labels: Path | None = None) -> Listing:
    if labels is None:
        labels = next((root / n for n in ("labels.csv", "labels.json") if (root / n).is_file()), None)
    label_map = _read_labels(labels) if labels else None
    classes = None
    if label_map is not None:
        values = set(label_map.values())
        if all(re.fullmatch(r"-?\d+", v) for v in values):
            to_int = {v: int(v) for v in values}
        else:
            classes = sorted(values)
            to_int = {c: i for i, c in enumerate(classes)}
    listing = Listing("npy", [], classes=classes)
    keys = _KeyRegistry()
    for path in _walk(root):
        if labels is not None and path.resolve() == labels.resolve():
            continue
        name = path.relative_to(root).as_posix()
        if not name.endswith(".npy"):
            listing.rejects.append({"source": str(path), "key": "", "reason": "not an .npy file"})
            continue
        stem = name[: -len(".npy")]
        key = _key_from_path(stem)
        size = _stat_size(path)
        ref = size if isinstance(size, str) else _npy_ref(path, size)
        if isinstance(ref, str):
            listing.rejects.append({"source": str(path), "key": key, "reason": ref})
            continue
        keys.add(key, str(path))
        fields: list[tuple[str, Ref]] = [("npy", ref)]
        if label_map is not None:
            label = label_map.get(stem, label_map.get(key))
            if label is None:
                raise InputError(f"labels file {labels} has no label for {stem!r} ({path})")
            fields.append(("cls", _label_ref(to_int[label])))
        listing.inputs.append(str(path))
        listing.samples.append(Sample(key, tuple(fields)))
    return listing


# -- WebDataset tars -----------------------------------------------------------------------------
class _GuardedTarInfo(tarfile.TarInfo):
    """Refuses PAX and GNU long-name headers above MAX_PAX_NBYTES before tarfile reads them."""

    def _proc_pax(self, tf):  # noqa: D401 - tarfile hook
        self._check_meta_size(tf)
        return super()._proc_pax(tf)

    def _proc_gnulong(self, tf):
        self._check_meta_size(tf)
        return super()._proc_gnulong(tf)

    def _check_meta_size(self, tf) -> None:
        if self.size > MAX_PAX_NBYTES:
            raise InputError(
                f"{tf.name}: extended header at offset {self.offset} is {self.size} bytes "
                f"(limit {MAX_PAX_NBYTES}); refusing a hostile or corrupt tar"
            )


def expand_tar_paths(src: str) -> list[Path]:
    """A tar file, a folder of tars, or a brace pattern like `train-{000000..000099}.tar`."""
    if "{" in src:
        import braceexpand

        paths = [Path(p) for p in braceexpand.braceexpand(src)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise InputError(
                f"{len(missing)} of {len(paths)} tars from pattern {src!r} do not exist, "
                f"first: {missing[0]}"
            )
        return paths
    p = Path(src)
    if p.is_dir():
        paths = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(".tar") and _visible(q.name))
        if not paths:
            raise InputError(f"{src}: no .tar files in this folder")
        return paths
    if p.is_file():
        return [p]
    raise InputError(f"{src}: no such file or folder")


def scan_tar(path: Path) -> list[tuple[str, str, int, int]]:
    """Regular members of an uncompressed tar as (key, ext, data offset, size), in tar order.

    Refuses absolute or `..` names, links, devices and FIFOs, oversized extended headers and
    truncation, naming the tar and the member.
    """
    if path.suffix in (".gz", ".tgz", ".bz2", ".xz", ".zst"):
        raise InputError(f"{path}: compressed tars are not supported; decompress it first")
    size = path.stat().st_size
    out = []
    try:
        with tarfile.open(path, "r:", tarinfo=_GuardedTarInfo) as tf:
            for m in tf:
                name = m.name
                where = f"{path}: member {name!r}"
                if name.startswith("/") or re.match(r"^[A-Za-z]:[/\\]", name):
                    raise InputError(f"{where} has an absolute path; refusing the tar")
                if ".." in name.replace("\\", "/").split("/"):
                    raise InputError(f"{where} escapes the archive with '..'; refusing the tar")
                if m.issym() or m.islnk():
                    raise InputError(f"{where} is a {'symbolic' if m.issym() else 'hard'} link (to {m.linkname!r}); links are refused")
                if m.isdir():
                    continue
                if not m.isreg():
                    raise InputError(f"{where} is a device, FIFO or other special file; refused")
                if m.offset_data + m.size > size:
                    raise InputError(f"{where}: tar is truncated (member needs {m.offset_data + m.size} bytes, file has {size})")
                base = name.rsplit("/", 1)[-1]
                if not _visible(base) or base.startswith("__"):
                    continue
                key, ext = split_name(name.removeprefix("./"))
                if not ext:
                    raise InputError(f"{where} has no extension, so it belongs to no field")
                out.append((key, ext, m.offset_data, m.size))
    except tarfile.ReadError as exc:
        raise InputError(f"{path}: not a readable tar or truncated ({exc})") from exc
    except (EOFError, tarfile.TarError) as exc:
        raise InputError(f"{path}: corrupt tar ({exc})") from exc
    return out


def list_tars(src: str) -> Listing:
    listing = Listing("tar", [])
    keys = _KeyRegistry()
    for path in expand_tar_paths(src):
        listing.inputs.append(str(path))
        current: list[tuple[str, Ref]] = []
        current_key = None
        exts: set[str] = set()

        def flush() -> None:
            if current_key is not None:
                listing.samples.append(Sample(current_key, tuple(current)))

        for key, ext, off, size in scan_tar(path):
            if key != current_key:
                flush()
                keys.add(key, f"{path}: member {key + '.' + ext!r} at offset {off}")
                current, current_key, exts = [], key, set()
            if ext in exts:
                raise InputError(f"{path}: member {key}.{ext} appears twice in one sample")
            exts.add(ext)
            if ext == "npy":
                ref: Ref | str = _npy_ref(path, size, off)
                if isinstance(ref, str):
                    raise InputError(f"{path}: member {key}.npy: {ref}")
            else:
                ref = Ref(str(path), off, size, shard_nbytes=size)
            current.append((ext, ref))
        flush()
    return listing


# -- detection -----------------------------------------------------------------------------------
def detect(src: str) -> SourceFormat:
    if "{" in src or src.endswith(".tar"):
        return "tar"
    p = Path(src)
    if not p.exists():
        raise InputError(f"{src}: no such file or folder")
    if not p.is_dir():
        raise InputError(f"{src}: expected a folder, a .tar file or a brace pattern of tars")
    entries = [e for e in p.iterdir() if _visible(e.name)]
    if not entries:
        raise InputError(f"{src}: the folder is empty")
    files = [e for e in entries if not e.is_dir()]
    if not files:
        return "imagefolder"
    if all(e.name.endswith(".tar") for e in files) and len(files) == len(entries):
        return "tar"
    names = {e.name for e in files}
    if all(n.endswith(".npy") or n in ("labels.csv", "labels.json") for n in names) and len(files) == len(entries):
        return "npy"
    return "files"


def list_source(src: str, fmt: SourceFormat | None = None, *, labels: str | None = None) -> Listing:
    fmt = fmt or detect(src)
    if fmt == "tar":
        return list_tars(src)
    root = Path(src)
    if not root.is_dir():
        raise InputError(f"{src}: not a folder (format {fmt!r} reads a folder)")
    if fmt == "imagefolder":
        return list_imagefolder(root)
    if fmt == "npy":
        return list_npy(root, Path(labels) if labels else None)
    if labels:
        raise InputError("--labels applies to .npy folders only")
    return list_files(root)
