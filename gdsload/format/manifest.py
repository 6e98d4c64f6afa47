"""`manifest.json`: the dataset's table of contents, written last.

A dataset is complete exactly when its `manifest.json` exists: conversion writes shards under
temporary names, renames each when complete, and writes the manifest (itself through a temporary
name and an atomic rename) only after every shard is in place.

Layout (version 1)::

    {"format": "gdsload", "version": 1,
     "num_samples": 1281167, "num_bytes": ...,
     "shards": [{"name": "shard-000000.tar", "index": "shard-000000.idx",
                 "dali_index": "shard-000000.dali.idx", "samples": 9000, "bytes": 1073741824,
                 "sha256": "..."}, ...],
     "fields": {"jpg": "image", "cls": "label"},
     "classes": ["n01440764", ...] or null,
     "created": {"by": "gdsload 0.1.0", "at": "2026-12-02T11:00:00Z", "source": "...",
                 "source_format": "imagefolder", "options": {...}, "rejected": 0}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from gdsload.errors import FormatError
from gdsload.format.store import Store, open_store

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "jp2"})
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


def field_kind(ext: str) -> str:
    """How a field is decoded: image, tensor, label, json, text, or bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTS:
        return "image"
    return _KINDS.get(last, "bytes")


def save(root: str | Path | Store, manifest: dict[str, Any]) -> None:
    """Write `root/manifest.json` (a local path, an fsspec URL or a `Store`); see `store` for how
    it becomes visible. Conversion calls this last."""
    open_store(root).write(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def load(root: str | Path | Store) -> dict[str, Any]:
    """Read and check the manifest of the dataset at `root` (a local path, an fsspec URL or a
    `Store`)."""
    store = open_store(root)
    try:
        text = store.read(MANIFEST).decode()
    except FileNotFoundError:
        hint = ""
        if store.exists(".gdsload-convert"):
            hint = " (a conversion into it was interrupted; re-run gdsload convert with --resume)"
        elif not store.exists():
            hint = " (the folder does not exist)"
        raise FormatError(f"{store.root}: no {MANIFEST}, so this is not a complete gdsload dataset{hint}") from None
    return parse(text, name=store.where(MANIFEST))


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
    if sum(s["samples"] for s in shards) != m.get("num_samples"):
        raise FormatError(f"{name}: num_samples does not equal the sum over shards")
    return m
