"""Conversion inputs: find the samples of an image folder, a `KEY.EXT` folder, WebDataset tars or
an `.npy` folder, without reading payloads.

A source is listed into `Sample`s: a key and, per field, a `Ref` saying where the bytes are (a
file, a byte range of an input tar, or inline bytes for labels) and how many bytes the field will
take in a shard. Listing is cheap (stat and tar headers only) and deterministic: sorted by path.

Per-file problems that lose one sample (an empty file or tar member, a non-image file in an image
folder, an invalid `.npy`, a symbolic link inside a folder, a name that is not UTF-8, a file next
to the class folders of an image folder) become rejects with a reason; a sample with a bad field is
left out whole. Problems that make the input untrustworthy or ambiguous (path traversal, links or
devices in a tar, a link among a folder's tars, an oversized PAX header, a truncated tar, a tar
header that does not parse, duplicate keys, a missing path, an ambiguous layout) raise `InputError`
naming the file and member (and, for tar headers, the byte offset).

Links: the path the user names (SRC, a single `.tar`) may be a symbolic link; nothing found inside
it is followed (a link could point anywhere, e.g. `/etc/passwd`). Names must be UTF-8 (keys go
into PAX headers, JSON and DALI's index); rejects show other bytes as `\\xNN`.

Key rules (webdataset splits member names at the first dot of the base name, DALI's index is
whitespace-separated): keys made from file names have dots and whitespace replaced by `_`; keys
read from tars must already be valid. Two inputs that map to the same key are an error naming both.
Hidden files (name starting with `.`) are ignored.

Where the inputs are: a local path, or an fsspec URL (`s3://bucket/train/`, `gs://...`,
`memory://...`), listed through fsspec with recursive listings (`find`: one per class folder of
an image folder, one for the other layouts), never one query per file, so that Ray workers on
other nodes can read what the driver listed. Ref paths are then full URLs, and payloads are read
as byte ranges (`read_range`). The walk order, and so the output, is the same as for the same
files on a local disk. Remote-only differences: permissions are not probed while listing (an
unreadable object is rejected when its shard is written), and the resume fingerprint uses the
object's ETag or modification time as the store reports it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

from gdsload.errors import FormatError, InputError
from gdsload.format import npy
from gdsload.format.index import check_key, split_name
from gdsload.format.manifest import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS
from gdsload.io import is_remote, local_path
from gdsload.io.store import url_to_fs
from gdsload.format.tar import ALIGN, BLOCK

SourceFormat = Literal["imagefolder", "files", "tar", "npy", "parquet", "arrow"]  # the last two: `columnar`

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


def printable(text: str) -> str:
    """`text` with bytes that are not UTF-8 (surrogate escapes from the file system) as `\\xNN`."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _not_utf8(name: str) -> str | None:
    """The reject reason for a name that is not valid UTF-8, or None."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"name '{printable(name)}' is not valid UTF-8; rename it (keys and manifests are UTF-8)"
    return None


@dataclass
class Listing:
    format: SourceFormat
    samples: list[Sample]
    rejects: list[dict[str, str]] = field(default_factory=list)
    classes: list[str] | None = None
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (file, stamp) read: resume fingerprint

    def reject(self, source: str, key: str, reason: str) -> None:
        self.rejects.append({"source": printable(source), "key": printable(key), "reason": reason})


_SANITIZE = re.compile(r"[\s.]")


def _key_from_path(rel: str) -> str:
    return "/".join(_SANITIZE.sub("_", part) for part in rel.split("/"))


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _file_ref(path: str, size: int) -> Ref:
    return Ref(path, 0, size, shard_nbytes=size)


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


# -- where the inputs are -------------------------------------------------------------------------
@dataclass(frozen=True)
class _File:
    path: str  # a local path or a full URL, as it goes into `Ref.path`
    rel: str  # the path relative to the folder walked, `/`-separated
    size: int | str  # bytes, or the reason the file is rejected (unreadable, a link, not UTF-8)
    stamp: str  # identity for the resume fingerprint: size and mtime (or ETag)


class _LocalTree:
    """Input files on a local disk (or a mounted shared filesystem)."""

    def norm(self, src: str) -> str:
        return str(local_path(src))

    def join(self, root: str, name: str) -> str:
        return os.path.join(root, name)

    def kind(self, path: str) -> str | None:
        """"dir", "file" or None (missing)."""
        p = Path(path)
        return "dir" if p.is_dir() else "file" if p.exists() else None

    def children(self, root: str) -> list[tuple[str, bool, str | None]]:
        """(name, is a folder (links followed), the reject reason if it is a link) of the entries
        directly in root."""
        return [(e.name, e.is_dir(), _link_reason(e.path) if e.is_symlink() else None) for e in os.scandir(root)]

    def files_in(self, folder: str) -> dict[str, _File]:
        """The files and links directly in folder by name ({} if it is missing); `rel` is the
        name; a link's `size` is the reason it is refused."""
        try:
            return {e.name: self.stat(e.path, e.name, follow=False) for e in os.scandir(folder)
                    if e.is_file() or e.is_symlink()}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def stat(self, path: str, rel: str = "", *, follow: bool = True) -> _File:
        """`path`'s size and stamp, or the reason it is rejected; `follow=False`: a link is one."""
        if not follow and os.path.islink(path):
            return _File(path, rel, _link_reason(path), "link")
        bad_name = _not_utf8(rel or path)
        if bad_name:
            return _File(path, rel, bad_name, "not-utf8")
        try:
            st = os.stat(path)
        except OSError as exc:
            return _File(path, rel, f"unreadable: {exc.strerror or exc}", "missing")
        if not os.access(path, os.R_OK):
            return _File(path, rel, "unreadable: permission denied", "unreadable")
        return _File(path, rel, st.st_size, f"{st.st_size}|{st.st_mtime_ns}")

    def walk(self, root: str) -> list[_File]:
        """Files under root in `os.walk` order: sorted, a folder's files before its sub-folders,
        hidden ones skipped. Links (to files or folders, or dangling) are listed, not followed:
        their `size` is the reason they are rejected."""
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            dirnames[:] = sorted(d for d in dirnames if _visible(d) and d not in links)
            prefix = os.path.relpath(dirpath, root).replace(os.sep, "/")
            prefix = "" if prefix == "." else prefix + "/"
            names = sorted(n for n in filenames + links if _visible(n))
            out += [self.stat(os.path.join(dirpath, f), prefix + f, follow=False) for f in names]
        return out

    def open(self, path: str) -> BinaryIO:
        return open(path, "rb")


class _FsspecTree:
    """Input files behind an fsspec URL; paths handed out are full URLs."""

    def __init__(self, url: str):
        self.fs, _ = url_to_fs(url)

    def norm(self, src: str) -> str:
        return self.fs.unstrip_protocol(self.fs._strip_protocol(src).rstrip("/"))

    def join(self, root: str, name: str) -> str:
        return f"{root}/{name}"

    def _info_file(self, info: dict[str, Any], rel: str = "") -> _File:
        tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") \
            or info.get("LastModified") or info.get("last_modified") or info.get("updated") or ""
        size = int(info.get("size") or 0)
        return _File(self.fs.unstrip_protocol(info["name"]), rel, size, f"{size}|{tag}")

    def kind(self, path: str) -> str | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return "dir" if info.get("type") == "directory" else "file"

    def children(self, root: str) -> list[tuple[str, bool, str | None]]:
        return [(e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type") == "directory", None)
                for e in self.fs.ls(root, detail=True)]

    def files_in(self, folder: str) -> dict[str, _File]:
        try:
            entries = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for e in entries:
            if e.get("type") == "file":
                name = e["name"].rsplit("/", 1)[-1]
                out[name] = self._info_file(e, name)
        return out

    def stat(self, path: str, rel: str = "") -> _File:
        try:
            return self._info_file(self.fs.info(path), rel)
        except OSError as exc:
            return _File(path, rel, f"unreadable: {exc.strerror or exc}", "missing")

    def walk(self, root: str) -> list[_File]:
        """One recursive listing, ordered as `_LocalTree.walk` orders the same files."""
        base = self.fs._strip_protocol(root).rstrip("/")
        found = self.fs.find(base, detail=True, withdirs=False)
        rows = []
        for name, info in found.items():
            parts = name[len(base) + 1:].split("/")
            if name.startswith(base + "/") and all(_visible(p) for p in parts):
                # os.walk order: within a folder, its files first (0), then its sub-folders (1)
                rows.append(([(1, d) for d in parts[:-1]] + [(0, parts[-1])], "/".join(parts), info))
        return [self._info_file(info, rel) for _, rel, info in sorted(rows, key=lambda r: r[0])]

    def open(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb")


def _link_reason(path: str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return f"symbolic link (to '{printable(target)}'); links inside the input are not followed"


def _tree(src: str) -> _LocalTree | _FsspecTree:
    return _FsspecTree(src) if is_remote(src) else _LocalTree()


def read_range(path: str, offset: int = 0, size: int = -1, *, follow_link: bool = False) -> bytes:
    """`size` bytes of the input `path` (a local path or a URL) from `offset`; -1: to the end.

    A local file is opened with O_NOFOLLOW unless `follow_link`: a file swapped for a link after
    it was listed raises OSError (its sample becomes a reject) instead of reading the link's target.
    """
    if is_remote(path):
        fs, p = url_to_fs(path)
        return fs.cat_file(p, start=offset, end=None if size < 0 else offset + size)
    flags = os.O_RDONLY | (0 if follow_link else getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(os.open(local_path(path), flags), "rb") as f:
        f.seek(offset)
        return f.read() if size < 0 else f.read(size)


# -- image folder --------------------------------------------------------------------------------
# The image types DALI decodes (gdsload's decoder); it has no GIF decoder, so a GIF is a reject.
DECODABLE_EXTS = IMAGE_EXTS - {"gif"}
MIXED_IMAGE_FIELD = "jpg"  # the one field name of an image folder whose images have several types


def list_imagefolder(tree: _LocalTree | _FsspecTree, root: str) -> Listing:
    """Every image of an image folder goes into one field, so that a loader can decode it: named
    after the image type when all have one (`.jpeg` counts as jpg), else `MIXED_IMAGE_FIELD`. The
    bytes are unchanged; decoders (DALI, Pillow) read the real type from them."""
    listing = Listing("imagefolder", [], classes=[])
    classes = []
    for name, is_dir, link in sorted(tree.children(root)):
        if not _visible(name):
            continue
        where = tree.join(root, name)
        reason = link or _not_utf8(name)
        if reason is None and not is_dir:
            reason = "not in a class folder (an image folder holds ROOT/CLASS/IMAGE files)"
        if reason:
            listing.reject(where, "", reason + ("; its files are left out" if is_dir and not link else ""))
        else:
            classes.append(name)
    if not classes:
        raise InputError(f"{root}: no class sub-folders found (expected ROOT/CLASS/IMAGE.jpg)")
    listing.classes = classes
    keys = _KeyRegistry()
    types = set()
    for label, cls in enumerate(classes):
        for f in tree.walk(tree.join(root, cls)):
            path, rel, size = f.path, f"{cls}/{f.rel}", f.size
            # the image type is the last suffix: "img.001.jpg" is image "img.001" of type jpg
            stem, dot, ext = rel.rpartition(".")
            if not dot or "/" in ext:
                stem, ext = rel, ""
            ext = ext.lower()
            reject = None
            if ext in VIDEO_EXTS or ext in AUDIO_EXTS:  # a folder of clips or recordings per class
                pass
            elif ext not in IMAGE_EXTS:
                reject = (f"not an image, video or audio file (extension {ext!r})" if ext
                          else "not an image file (no extension)")
            elif ext not in DECODABLE_EXTS:
                reject = f"{ext.upper()} images are not decoded by DALI (gdsload's decoder); convert them to PNG"
            if isinstance(size, str):
                reject = size
            elif size == 0:
                reject = "empty file (0 bytes)"
            key = _key_from_path(stem)
            if reject:
                listing.reject(path, key, reject)
                continue
            keys.add(key, path)
            ext = "jpg" if ext == "jpeg" else ext
            types.add(ext)
            listing.inputs.append((path, f.stamp))
            listing.samples.append(Sample(key, ((ext, _file_ref(path, size)), ("cls", _label_ref(label)))))
    kinds = {"video" if t in VIDEO_EXTS else "audio" if t in AUDIO_EXTS else "image" for t in types}
    if len(kinds) > 1:
        raise InputError(f"{root}: class folders mix {' and '.join(sorted(kinds))} files; a sample has "
                         f"one field of one kind: convert each kind into a dataset of its own")
    if len(types) > 1 and kinds != {"image"}:  # e.g. mp4 and webm: one field the decoders sniff
        raise InputError(f"{root}: class folders hold {kinds.pop()} files of several types "
                         f"({', '.join(sorted(types))}); use one container type per dataset")
    if len(types) > 1:
        listing.samples = [Sample(s.key, ((MIXED_IMAGE_FIELD, s.fields[0][1]), s.fields[1])) for s in listing.samples]
    return listing


# -- KEY.EXT folder ------------------------------------------------------------------------------
def list_files(tree: _LocalTree | _FsspecTree, root: str) -> Listing:
    """Files sharing a key form one sample; a sample with a file that is rejected (unreadable,
    empty, a link, an invalid `.npy`) is left out whole, so no sample lacks one of its fields."""
    listing = Listing("files", [])
    groups: dict[str, list[tuple[str, str, int | str, str]]] = {}
    owner: dict[tuple[str, str], str] = {}
    for f in tree.walk(root):
        path, size = f.path, f.size
        stem, ext = split_name(f.rel)
        key = _key_from_path(stem)
        if not ext:
            listing.reject(path, key, size if isinstance(size, str) else "no extension, so no field name")
            continue
        other = owner.setdefault((key, ext.lower()), path)
        if other != path:
            raise InputError(f"duplicate field {key}.{ext.lower()}: {other} and {path}")
        groups.setdefault(key, []).append((ext.lower(), path, size, f.stamp))
    keys = _KeyRegistry()
    for key in sorted(groups):
        members = sorted(groups[key], key=lambda m: m[0])
        bad = [(path, size) for _, path, size, _ in members if isinstance(size, str)]
        for path, reason in bad:
            listing.reject(path, key, str(reason))
        if bad:
            continue
        keys.add(key, members[0][1])
        fields = []
        for ext, path, size, stamp in members:
            ref = _npy_ref(path, size) if ext == "npy" else _file_ref(path, size)
            if size == 0:
                ref = "empty file (0 bytes)"
            if isinstance(ref, str):
                listing.reject(path, key, ref)
                break
            fields.append((ext, ref))
            listing.inputs.append((path, stamp))
        else:
            listing.samples.append(Sample(key, tuple(fields)))
    if not listing.samples and not listing.rejects:
        raise InputError(f"{root}: no files found")
    return listing


# -- .npy folder ---------------------------------------------------------------------------------
def _npy_ref(path: str, size: int, offset: int = 0) -> Ref | str:
    """A Ref for an .npy payload with its shard size after realignment, or a reject reason."""
    try:
        head = read_range(path, offset, min(size, 1 << 16))
        dtype, shape, _, data_off = npy.parse_header(head)
    except (FormatError, OSError) as exc:
        return f"not a valid .npy file: {exc}"
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if data_off + nbytes != size:
        return f"truncated .npy: {size} bytes, its header needs {data_off + nbytes}"
    realign = size >= ALIGN and data_off != ALIGN
    return Ref(path, offset, size, npy_realign=realign, shard_nbytes=ALIGN + nbytes if realign else size)


def _read_labels(path: str) -> dict[str, str]:
    try:
        text = read_range(path, follow_link=True).decode()  # a file the user named
        if path.endswith(".json"):
            data = json.loads(text)
            if not isinstance(data, dict):
                raise InputError(f"{path}: expected a JSON object mapping key to label")
            return {str(k): str(v) for k, v in data.items()}
        rows = list(csv.reader(io.StringIO(text, newline="")))
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


def _same_file(a: str, b: str) -> bool:
    return a == b or (not is_remote(a) and not is_remote(b) and os.path.realpath(a) == os.path.realpath(b))


def list_npy(tree: _LocalTree | _FsspecTree, root: str, labels: str | None = None) -> Listing:
    if labels is None:
        files = {name: link for name, is_dir, link in tree.children(root) if not is_dir}
        found = next((n for n in ("labels.csv", "labels.json") if n in files), None)
        labels = tree.join(root, found) if found else None
        if found and files[found]:
            raise InputError(f"labels file {labels} is a {files[found]}; pass the file itself with --labels")
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
    for f in tree.walk(root):
        path, name, size = f.path, f.rel, f.size
        if labels is not None and _same_file(path, labels):
            continue
        if not name.endswith(".npy"):
            listing.reject(path, "", size if isinstance(size, str) else "not an .npy file")
            continue
        stem = name[: -len(".npy")]
        key = _key_from_path(stem)
        ref = size if isinstance(size, str) else _npy_ref(path, size)
        if isinstance(ref, str):
            listing.reject(path, key, ref)
            continue
        keys.add(key, path)
        fields: list[tuple[str, Ref]] = [("npy", ref)]
        if label_map is not None:
            label = label_map.get(stem, label_map.get(key))
            if label is None:
                raise InputError(f"labels file {labels} has no label for {stem!r} ({path})")
            fields.append(("cls", _label_ref(to_int[label])))
        listing.inputs.append((path, f.stamp))
        listing.samples.append(Sample(key, tuple(fields)))
    return listing


# -- WebDataset tars -----------------------------------------------------------------------------
class _HostileHeader(InputError):
    """Raised inside tarfile's parsing, which does not know the tar's path; `scan_tar` adds it."""


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
            raise _HostileHeader(
                f"extended header at offset {self.offset} is {self.size} bytes "
                f"(limit {MAX_PAX_NBYTES}); refusing a hostile or corrupt tar"
            )


def expand_tar_paths(tree: _LocalTree | _FsspecTree, src: str) -> tuple[list[_File], list[_File]]:
    """A tar file, a folder of tars, or a brace pattern like `train-{000000..000099}.tar`: the
    tars, and the other visible files of a folder of tars (left out, as rejects)."""
    if "{" in src:
        import braceexpand

        paths = [tree.norm(p) for p in braceexpand.braceexpand(src)]
        listed: dict[str, dict[str, _File]] = {}  # one listing per folder, not one query per tar
        found: list[_File | None] = []
        for p in paths:
            folder, _, name = p.rpartition("/") if "/" in p else (".", "", p)
            if folder not in listed:
                listed[folder] = tree.files_in(folder or "/")
            f = listed[folder].get(name)
            found.append(f if f is None else replace(f, path=p, rel=p))
        missing = [p for p, f in zip(paths, found) if f is None]
        if missing:
            raise InputError(
                f"{len(missing)} of {len(paths)} tars from pattern {src!r} do not exist, "
                f"first: {missing[0]}"
            )
        return [f for f in found if f is not None], []
    src = tree.norm(src)
    kind = tree.kind(src)
    if kind == "dir":
        files = tree.files_in(src)
        visible = [files[n] for n in sorted(files) if _visible(n)]
        tars = [f for f in visible if f.path.endswith(".tar")]
        if not tars:
            raise InputError(f"{src}: no .tar files in this folder")
        return tars, [f for f in visible if not f.path.endswith(".tar")]
    if kind == "file":  # the tar named: it may be a link, read as the file it points at
        link = not is_remote(src) and os.path.islink(src)
        return [tree.stat(os.path.realpath(src) if link else src, src)], []
    raise InputError(f"{src}: no such file or folder")


def _check_tar_end(fh: BinaryIO, end: int, size: int, path: str, members: int) -> None:
    """Refuse a tar whose bytes after the last member tarfile read are not all zeros.

    tarfile ends its iteration without an error at the first header it cannot parse (a bad
    checksum, garbage) and at a zero block, so a damaged header in the middle would silently drop
    every member after it. A sound tar has only its end-of-archive marker and record padding
    (zeros) there, or nothing.
    """
    fh.seek(end)
    block = fh.read(BLOCK)
    if block.strip(b"\0"):
        try:
            tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            why = "cannot be parsed"
        except tarfile.HeaderError as exc:
            why = str(exc) or "cannot be parsed"
        raise InputError(
            f"{path}: corrupt tar header at byte offset {end} ({why}) after {members} members; the "
            f"members after it cannot be read; refusing the tar (repair or re-create it)"
        )
    pos = end + len(block)
    while pos < size:
        chunk = fh.read(1 << 20)
        if not chunk:
            break
        first = len(chunk) - len(chunk.lstrip(b"\0"))  # of a byte that is not zero
        if first < len(chunk):
            raise InputError(
                f"{path}: data at byte offset {pos + first} after the end-of-archive marker at offset "
                f"{end} (after {members} members): a zeroed header or a second archive hides members "
                f"there; refusing the tar"
            )
        pos += len(chunk)


@dataclass(frozen=True)
class _Member:
    key: str
    ext: str
    offset: int  # of the payload
    size: int
    problem: str | None = None  # the reason its sample is rejected (empty, name not UTF-8)


def scan_tar(tree: _LocalTree | _FsspecTree, tar: _File) -> list[_Member]:
    """Regular members of an uncompressed tar, in tar order.

    Refuses absolute or `..` names, links, devices and FIFOs, oversized extended headers,
    truncation and headers that do not parse (naming the tar, the member or the byte offset);
    marks empty members and names that are not UTF-8 as problems that reject their sample.
    """
    path, size = tar.path, tar.size
    if path.endswith((".gz", ".tgz", ".bz2", ".xz", ".zst")):
        raise InputError(f"{path}: compressed tars are not supported; decompress it first")
    if isinstance(size, str):
        raise InputError(f"{printable(path)}: {size}")
    out = []
    try:
        with tree.open(path) as fh, tarfile.open(fileobj=fh, mode="r:", tarinfo=_GuardedTarInfo) as tf:
            count = 0
            for m in tf:
                count += 1
                name = m.name
                where = f"{path}: member {printable(name)!r}"
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
                problem = _not_utf8(name)
                if problem is None and m.size == 0:
                    problem = f"empty member {name!r} at offset {m.offset_data} (0 bytes)"
                out.append(_Member(key, ext, m.offset_data, m.size, problem))
            _check_tar_end(fh, tf.offset, size, path, count)
    except _HostileHeader as exc:
        raise InputError(f"{path}: {exc}") from None
    except tarfile.ReadError as exc:
        raise InputError(f"{path}: not a readable tar or truncated ({exc})") from exc
    except (EOFError, tarfile.TarError) as exc:
        raise InputError(f"{path}: corrupt tar ({exc})") from exc
    return out


def list_tars(tree: _LocalTree | _FsspecTree, src: str) -> Listing:
    """Consecutive members sharing a key form a sample; a sample with an empty member or a name
    that is not UTF-8 is a reject (as an empty or misnamed file in a folder is)."""
    listing = Listing("tar", [])
    keys = _KeyRegistry()
    tars, others = expand_tar_paths(tree, src)
    for f in others:
        listing.reject(f.path, "", "not a .tar file (a folder of tars is read for its .tar files)")
    for tar in tars:
        path = tar.path
        listing.inputs.append((path, tar.stamp))
        current: list[tuple[str, Ref]] = []
        current_key = None
        exts: set[str] = set()
        problem: str | None = None

        def flush() -> None:
            if current_key is None:
                return
            if problem:
                listing.reject(path, current_key, problem)
            else:
                listing.samples.append(Sample(current_key, tuple(current)))

        for m in scan_tar(tree, tar):
            key, ext, off, size = m.key, m.ext, m.offset, m.size
            if key != current_key:
                flush()
                if _not_utf8(key) is None:
                    keys.add(key, f"{path}: member {key + '.' + ext!r} at offset {off}")
                current, current_key, exts, problem = [], key, set(), None
            if ext in exts:
                raise InputError(f"{path}: member {printable(key)}.{printable(ext)} appears twice in one sample")
            exts.add(ext)
            problem = problem or m.problem
            if problem:
                continue
            if ext == "npy":
                ref: Ref | str = _npy_ref(path, size, off)
                if isinstance(ref, str):
                    raise InputError(f"{path}: member {key}.npy: {ref}")
            else:
                ref = Ref(path, off, size, shard_nbytes=size)
            current.append((ext, ref))
        flush()
    return listing


# -- detection -----------------------------------------------------------------------------------
def _is_image_name(name: str) -> bool:
    return "." in name and name.rpartition(".")[2].lower() in IMAGE_EXTS


def detect(src: str) -> SourceFormat:
    """The layout of `src`, from the names directly in it; files that belong to no sample of that
    layout (a README, LICENSE, classes.csv) do not change it, and become rejects when listed.

    - sub-folders and, next to them, files that share a key (`a.jpg a.json`): a `KEY.EXT` folder;
    - sub-folders: an image folder, unless images, `.npy` or `.tar` files lie next to them (then
      it is ambiguous, and refused);
    - `.tar` files, with no other data file sharing a key with a tar: tars;
    - `.npy` files (and `labels.csv`/`labels.json`), likewise: an `.npy` folder;
    - anything else: a `KEY.EXT` folder.
    """
    if "{" in src or src.endswith(".tar"):
        return "tar"
    tree = _tree(src)
    root = tree.norm(src)
    kind = tree.kind(root)
    if kind is None:
        raise InputError(f"{src}: no such file or folder")
    if kind != "dir":
        raise InputError(f"{src}: expected a folder, a .tar file or a brace pattern of tars")
    entries = [(n, d) for n, d, _ in tree.children(root) if _visible(n)]
    if not entries:
        raise InputError(f"{src}: the folder is empty")
    dirs = sorted(n for n, is_dir in entries if is_dir)
    names = sorted(n for n, is_dir in entries if not is_dir)
    if dirs:
        stems = [split_name(n)[0] for n in names]
        if len(set(stems)) < len(stems):
            return "files"
        data = [n for n in names if _is_image_name(n) or n.endswith((".npy", ".tar"))]
        if data:
            raise InputError(
                f"{src}: ambiguous layout: sub-folders ({', '.join(printable(d) for d in dirs[:3])}"
                f"{', ...' if len(dirs) > 3 else ''}) and data files next to them "
                f"({', '.join(printable(n) for n in data[:3])}{', ...' if len(data) > 3 else ''}); "
                f"pass --format imagefolder (class folders; files next to them are left out), "
                f"--format files or --format npy"
            )
        return "imagefolder"
    for fmt, ext in (("tar", ".tar"), ("npy", ".npy")):
        data = [n for n in names if n.endswith(ext)]
        rest = [n for n in names if not n.endswith(ext) and n not in ("labels.csv", "labels.json")]
        if data and not any(n.endswith((".tar", ".npy")) or _is_image_name(n) for n in rest) \
                and not {split_name(n)[0] for n in data} & {split_name(n)[0] for n in rest}:
            return fmt  # type: ignore[return-value]
    return "files"


def list_source(src: str, fmt: SourceFormat | None = None, *, labels: str | None = None) -> Listing:
    """List `src` (a local path or an fsspec URL) as format `fmt` (default: detected)."""
    if _not_utf8(src):
        raise InputError(f"{printable(src)}: the path is not valid UTF-8; rename it")
    fmt = fmt or detect(src)
    tree = _tree(src)
    if fmt == "tar":
        return list_tars(tree, src)
    root = tree.norm(src)
    if tree.kind(root) != "dir":
        raise InputError(f"{src}: not a folder (format {fmt!r} reads a folder)")
    if fmt == "imagefolder":
        return list_imagefolder(tree, root)
    if fmt == "npy":
        if labels and not is_remote(labels):
            labels = str(local_path(labels))
        return list_npy(tree, root, labels)
    if labels:
        raise InputError("--labels applies to .npy folders only")
    return list_files(tree, root)
