"""`manifest.json`: the dataset's table of contents, written last.

A dataset is complete exactly when its `manifest.json` exists: conversion writes shards under
temporary names, renames each when complete, and writes the manifest (itself through a temporary
name and an atomic rename) only after every shard is in place.

Layout (version 1)::

    {"format": "gdsload", "version": 1,
     "num_samples": 1281167, "num_bytes": ...,
     "shards": [{"name": "shard-000000.tar", "index": "shard-000000.idx",
                 "dali_index": "shard-000000.dali.idx", "samples": 9000, "bytes": 1073741824,
                 "sha256": "...", "max_nbytes": {"jpg": 181234, "cls": 3},
                 "min_nbytes": {"jpg": 20871, "cls": 1},
                 "member_crc": true, "npy_c_order": true}, ...],
     "fields": {"jpg": "image", "cls": "label"},
     "classes": ["n01440764", ...] or null,
     "created": {"by": "gdsload 0.1.0", "at": "2026-12-02T11:00:00Z", "source": "...",
                 "source_format": "imagefolder", "options": {...}, "rejected": 0},
     "versions": [{"version": 1, "shards": 12, "num_samples": 9000, "at": "..."}, ...]}

Appends (`gdsload convert --append`, `gdsload.ShardWriter(append=True)`) add shards at the end
and a `versions` entry; shards already listed are never rewritten and class names are only ever
added at the end, so version K of a dataset is exactly its first `versions[K-1]["shards"]` shards
(`at_version`). A manifest without `versions` has one version: all its shards.
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

from gdsload.errors import FormatError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "jp2"})
# Stored unchanged; probed at conversion (the index's media columns); decoded only when a
# VideoTransform / AudioTransform asks for the field (else a loader returns their bytes).
VIDEO_EXTS = frozenset({"mp4", "mkv", "webm", "avi", "mov"})
AUDIO_EXTS = frozenset({"wav", "flac", "ogg", "opus", "mp3", "m4a"})
_KINDS = {"npy": "tensor", "cls": "label", "json": "json", "txt": "text"}


class _ShardEntryRequired(TypedDict):
    name: str
    index: str
    dali_index: str
    samples: int
    bytes: int
    sha256: str


class ShardEntry(_ShardEntryRequired, total=False):
    fortran_to_c: dict[str, int]  # .npy field -> Fortran-ordered payloads stored in C order
    # Written since the loader stopped loading every index at start-up (absent in older
    # manifests: the loader then reads the shard's index for them):
    max_nbytes: dict[str, int]  # field -> its largest member payload in the shard, in bytes
    min_nbytes: dict[str, int]  # field -> its smallest (equal to max: one size, a fixed-shape .npy)
    member_crc: bool  # the shard's index holds CRC32s
    npy_c_order: bool  # the shard's index vouches every .npy payload is C-ordered


def dataset_id(shards: list[ShardEntry]) -> str:
    """The identity of a dataset's content, for loader states: a hash of its shards' SHA-256s in
    order. An append gives a new id; version K's id is that of its first shards."""
    import hashlib

    h = hashlib.sha256()
    for s in shards:
        h.update(s["sha256"].encode())
    return h.hexdigest()[:16]


def versions(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The dataset's versions, oldest first: `{"version", "shards", "num_samples", ...}`."""
    listed = manifest.get("versions")
    if listed:
        return list(listed)
    return [{"version": 1, "shards": len(manifest["shards"]), "num_samples": manifest["num_samples"],
             "at": (manifest.get("created") or {}).get("at")}]


def at_version(manifest: dict[str, Any], version: int) -> dict[str, Any]:
    """The manifest as it was at `version` (1 = as first written): its first shards only."""
    known = versions(manifest)
    match = [v for v in known if v["version"] == version]
    if not match:
        raise FormatError(f"the dataset has no version {version!r} (versions: "
                          f"{', '.join(str(v['version']) for v in known)})")
    v = match[0]
    shards = manifest["shards"][: v["shards"]]
    out = dict(manifest, shards=shards, num_samples=sum(s["samples"] for s in shards),
               num_bytes=sum(s["bytes"] for s in shards))
    out["versions"] = [x for x in known if x["version"] <= version]
    if manifest.get("classes") is not None and v.get("classes") is not None:
        out["classes"] = manifest["classes"][: v["classes"]]
    return out


def field_kind(ext: str) -> str:
    """How a field is decoded: image, video, audio, tensor, label, json, text, or bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTS:
        return "image"
    if last in VIDEO_EXTS:
        return "video"
    if last in AUDIO_EXTS:
        return "audio"
    return _KINDS.get(last, "bytes")


def dumps(manifest: dict[str, Any]) -> bytes:
    """The bytes of `manifest.json` (what `gdsload.io.store.save_manifest` writes)."""
    return (json.dumps(manifest, indent=1) + "\n").encode()


def parse(text: str, *, name: str) -> dict[str, Any]:
    try:
        m = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(m, dict) or m.get("format") != "gdsload":
        raise FormatError(f"{name}: not a gdsload manifest")
    if m.get("version") != FORMAT_VERSION:
        raise FormatError(
            f"{name}: format version {m.get('version')!r} is not supported (this gdsload reads "
            f"version {FORMAT_VERSION})"
        )
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise FormatError(f"{name}: 'shards' must be a list of objects")
    for s in shards:
        missing = {"name", "index", "dali_index", "samples", "bytes", "sha256"} - s.keys()
        if missing:
            raise FormatError(f"{name}: shard entry {s.get('name')!r} lacks {sorted(missing)}")
        for key in ("name", "index", "dali_index"):
            if "/" in s[key] or s[key].startswith("."):
                raise FormatError(f"{name}: shard file name {s[key]!r} must be a plain file name")
        for which in ("max_nbytes", "min_nbytes"):
            sizes = s.get(which, {})
            if not isinstance(sizes, dict) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= s["bytes"] for v in sizes.values()):
                raise FormatError(f"{name}: shard entry {s['name']!r}: {which!r} must map fields to byte "
                                  f"counts within the shard's {s['bytes']} bytes")
    if sum(s["samples"] for s in shards) != m.get("num_samples"):
        raise FormatError(f"{name}: num_samples does not equal the sum over shards")
    for v in m.get("versions") or []:
        k = v.get("shards") if isinstance(v, dict) else None
        if not isinstance(k, int) or not 0 < k <= len(shards) or \
                v.get("num_samples") != sum(s["samples"] for s in shards[:k]):
            raise FormatError(f"{name}: version entry {v!r} does not match the shard list")
    return m
