"""Per-shard indexes: ours (`NAME.idx`) and DALI's (`NAME.dali.idx`).

`NAME.idx` is an uncompressed NumPy `.npz` holding flat arrays, so loading the index of a shard
with millions of members is a few array reads, never a tar scan:

- `meta`: UTF-8 JSON `{"format": "gdsload-index", "version": 1, "extensions": [...]}`
- `key_blob` (uint8) and `key_offsets` (int64, n+1): sample keys, concatenated UTF-8
- `sample_start` (int64, n+1): members of sample i are rows `sample_start[i]:sample_start[i+1]`
- `member_ext` (uint16, index into `extensions`), `member_offset` and `member_size` (uint64):
  the byte offset of each member's payload in the tar, and its length
- `member_crc` (uint32, optional): CRC32 (`zlib.crc32`) of each member's payload, for the
  loader's `verify=` checks
- `label_0`, `label_1`, ... (int64, n, optional): the values of the label fields that
  `meta["labels"]` lists, parsed and validated at conversion (`gdsload.format.labels`); a sample
  without that field holds 0 there (its member list says it has none)
- `meta["media"]` (optional) and `media_0`, `media_1`, ... (float64, (n, k)): per video or audio
  field, the metadata probed at conversion (`gdsload.decode.media.probe`), one row per sample:
  `meta["media"][i]` is `{"field": ext, "kind": "video"|"audio", "columns": [k names],
  "codecs": [...], "values": {column: [...]}}`: the `codec` column indexes `codecs`, another text
  column (`pix_fmt`) its list in `values`; NaN where a sample lacks the field.
  Older readers ignore them (they load only the arrays they name), so `gdsload verify` and older
  loaders still read such a shard; a loader without them probes the member itself.
- `meta["npy_c_order"]` (optional, true): every `.npy` payload of the shard was parsed at
  conversion and stored in C order (`npy.normalize`), so the loader need not read its header

The optional parts were added after version 1 without a version change: indexes without them
still load (the loader then parses labels and `.npy` headers itself), and older readers ignore
them. Opening an index checks its arrays against each other, and `check_extents` every member
against the shard's size, so a damaged index is a `FormatError` naming the file, never an
allocation of its bogus sizes.

`NAME.dali.idx` is the text format DALI's `wds2idx` writes (version `v1.2`): a header line
`v1.2 N`, then one line per sample of `ext offset size name` groups, offsets being payload
offsets. We write it ourselves because `wds2idx` takes offsets from GNU tar's block numbers and
would point into our PAX padding headers.

Keys follow the webdataset convention: a member `KEY.EXT` splits at the first dot of its base
name, so keys hold no dots; DALI's index is whitespace-separated, so keys hold no whitespace.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gdsload.errors import FormatError

INDEX_VERSION = 1
DALI_INDEX_VERSION = "v1.2"

_BAD_KEY = re.compile(r"[\s\x00-\x1f\x7f]")


def check_key(key: str) -> str:
    """Return `key` if it is a valid sample key, else raise FormatError naming the problem."""
    if not key:
        raise FormatError("empty sample key")
    if "." in key.rsplit("/", 1)[-1]:
        raise FormatError(f"sample key {key!r} contains a dot (webdataset splits names at the first dot)")
    if _BAD_KEY.search(key):
        raise FormatError(f"sample key {key!r} contains whitespace or control characters")
    if key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise FormatError(f"sample key {key!r} is absolute or has empty, '.' or '..' path parts")
    return key


def split_name(name: str) -> tuple[str, str]:
    """Split a member name `dir/KEY.EXT` into (`dir/KEY`, `EXT`) at the base name's first dot."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


@dataclass(frozen=True)
class ShardIndex:
    """The members of one shard. Arrays are read-only views; cheap to pickle to worker processes."""

    extensions: tuple[str, ...]
    key_blob: np.ndarray
    key_offsets: np.ndarray
    sample_start: np.ndarray
    member_ext: np.ndarray
    member_offset: np.ndarray
    member_size: np.ndarray
    member_crc: np.ndarray | None = None  # None: written before CRCs were stored
    labels: Mapping[str, np.ndarray] = field(default_factory=dict)  # label field -> int64 per sample
    npy_c_order: bool = False  # every .npy payload was checked and stored in C order
    # media field -> ({"kind", "columns", "codecs"}, float64 (n, k)): probed metadata per sample
    media: Mapping[str, tuple[dict, np.ndarray]] = field(default_factory=dict)

    def media_info(self, ext: str, i: int) -> dict | None:
        """The probed metadata of sample i's `ext` member (codec as its name), or None when the
        index holds none (converted before media were probed, or the sample lacks the field)."""
        got = self.media.get(ext)
        if got is None:
            return None
        desc, table = got
        row = table[i]
        if np.isnan(row[0]):
            return None
        out: dict = {"kind": desc["kind"]}
        for name, v in zip(desc["columns"], row.tolist()):
            if name == "codec":
                out["codec"] = desc["codecs"][int(v)]
            elif name in desc.get("values", {}) and not np.isnan(v):
                out[name] = desc["values"][name][int(v)]
            elif not np.isnan(v):  # NaN: not known
                out[name] = int(v) if float(v).is_integer() and name not in ("fps", "duration") else v
        return out

    @property
    def num_samples(self) -> int:
        return len(self.sample_start) - 1

    @property
    def num_members(self) -> int:
        return len(self.member_offset)

    def key(self, i: int) -> str:
        return bytes(self.key_blob[self.key_offsets[i] : self.key_offsets[i + 1]]).decode("utf-8")

    def keys(self) -> list[str]:
        blob = bytes(self.key_blob)
        offs = self.key_offsets.tolist()
        return [blob[a:b].decode("utf-8") for a, b in zip(offs, offs[1:])]

    def members(self, i: int) -> list[tuple[str, int, int]]:
        """(extension, payload offset, size) of sample i's members, in tar order."""
        a, b = int(self.sample_start[i]), int(self.sample_start[i + 1])
        return [
            (self.extensions[e], o, s)
            for e, o, s in zip(
                self.member_ext[a:b].tolist(),
                self.member_offset[a:b].tolist(),
                self.member_size[a:b].tolist(),
            )
        ]

    def crcs(self, i: int) -> list[int] | None:
        """CRC32 of sample i's member payloads (in `members(i)` order), or None if not stored."""
        if self.member_crc is None:
            return None
        return self.member_crc[int(self.sample_start[i]) : int(self.sample_start[i + 1])].tolist()

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        samples: list[tuple[str, list[tuple[str, int, int]]]],
        *,
        crc: Sequence[int] | None = None,
        labels: Sequence[Mapping[str, int]] | None = None,
        npy_c_order: bool = False,
        media: Sequence[Mapping[str, dict]] | None = None,
    ) -> "ShardIndex":
        """From `[(key, [(ext, offset, size), ...]), ...]` in tar order; optionally the CRC32 of
        every member (flat, in that order) and each sample's label values `{ext: int}`."""
        exts: dict[str, int] = {}
        keys = [k.encode("utf-8") for k, _ in samples]
        key_offsets = np.zeros(len(keys) + 1, np.int64)
        np.cumsum([len(k) for k in keys], out=key_offsets[1:])
        start = np.zeros(len(samples) + 1, np.int64)
        np.cumsum([len(m) for _, m in samples], out=start[1:])
        rows = [m for _, ms in samples for m in ms]
        ext_ids = [exts.setdefault(e, len(exts)) for e, _, _ in rows]
        columns: dict[str, np.ndarray] = {}
        for i, values in enumerate(labels or ()):
            for ext, v in values.items():
                columns.setdefault(ext, np.zeros(len(samples), np.int64))[i] = v
        tables: dict[str, tuple[dict, np.ndarray]] = {}
        for i, values in enumerate(media or ()):
            for ext, info in values.items():
                if ext not in tables:
                    cols = ["codec"] + sorted(k for k in info if k not in ("codec", "kind"))
                    tables[ext] = ({"kind": info["kind"], "columns": cols, "codecs": []},
                                   np.full((len(samples), len(cols)), np.nan))
                desc, table = tables[ext]
                codec = info.get("codec", "")
                if codec not in desc["codecs"]:
                    desc["codecs"].append(codec)
                for c, name in enumerate(desc["columns"]):
                    v = desc["codecs"].index(codec) if name == "codec" else info.get(name)
                    if isinstance(v, str):  # other text (pix_fmt): an index into its own table
                        known = desc.setdefault("values", {}).setdefault(name, [])
                        if v not in known:
                            known.append(v)
                        v = known.index(v)
                    table[i, c] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan
        return cls(
            extensions=tuple(exts),
            key_blob=np.frombuffer(b"".join(keys), np.uint8),
            key_offsets=key_offsets,
            sample_start=start,
            member_ext=np.asarray(ext_ids, np.uint16),
            member_offset=np.asarray([o for _, o, _ in rows], np.uint64),
            member_size=np.asarray([s for _, _, s in rows], np.uint64),
            member_crc=None if crc is None else np.asarray(crc, np.uint32),
            labels=dict(sorted(columns.items())),
            npy_c_order=npy_c_order,
            media=dict(sorted(tables.items())),
        )

    # -- our file ------------------------------------------------------------------------------
    def to_bytes(self, extra: Mapping[str, np.ndarray] | None = None) -> bytes:
        """The `.idx` file; `extra`: more named arrays stored beside ours (a token shard's document
        table, `gdsload.format.tokens`), which this class's reader ignores."""
        meta: dict = {"format": "gdsload-index", "version": INDEX_VERSION, "extensions": list(self.extensions)}
        optional: dict[str, np.ndarray] = {}
        if self.member_crc is not None:
            optional["member_crc"] = self.member_crc
        if self.labels:
            meta["labels"] = list(self.labels)
            optional.update({f"label_{i}": col for i, col in enumerate(self.labels.values())})
        if self.npy_c_order:
            meta["npy_c_order"] = True
        if self.media:
            meta["media"] = [{"field": ext, **desc} for ext, (desc, _) in self.media.items()]
            optional.update({f"media_{i}": t for i, (_, t) in enumerate(self.media.values())})
        buf = io.BytesIO()
        np.savez(
            buf,
            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
            key_blob=self.key_blob,
            key_offsets=self.key_offsets,
            sample_start=self.sample_start,
            member_ext=self.member_ext,
            member_offset=self.member_offset,
            member_size=self.member_size,
            **optional,
            **(extra or {}),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str = "<index>") -> "ShardIndex":
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != "gdsload-index":
                    raise FormatError(f"{name}: not a gdsload index")
                if meta.get("version") != INDEX_VERSION:
                    raise FormatError(
                        f"{name}: index version {meta.get('version')} is not supported "
                        f"(this gdsload reads version {INDEX_VERSION}); re-run gdsload convert"
                    )
                label_exts = meta.get("labels", [])
                if not isinstance(label_exts, list) or not all(isinstance(e, str) for e in label_exts):
                    raise FormatError(f"{name}: index meta 'labels' must be a list of field names")
                idx = cls(
                    extensions=tuple(meta["extensions"]),
                    **{k: z[k] for k in (
                        "key_blob", "key_offsets", "sample_start",
                        "member_ext", "member_offset", "member_size",
                    )},
                    member_crc=z["member_crc"] if "member_crc" in z.files else None,
                    labels={e: z[f"label_{i}"] for i, e in enumerate(label_exts)},
                    npy_c_order=meta.get("npy_c_order") is True,
                    media=_load_media(meta.get("media", []), z, name),
                )
        except FormatError:
            raise
        except Exception as exc:  # zipfile/numpy raise many types for a damaged file
            raise FormatError(f"{name}: unreadable index ({type(exc).__name__}: {exc})") from exc
        idx._check(name)
        return idx

    @classmethod
    def load(cls, path: str | Path) -> "ShardIndex":
        return cls.from_bytes(Path(path).read_bytes(), name=str(path))

    def _check(self, name: str) -> None:
        n = self.num_samples
        for ext, (desc, table) in self.media.items():
            if table.ndim != 2 or table.shape != (n, len(desc["columns"])):
                raise FormatError(f"{name}: media columns of field {ext!r} have shape {table.shape}, "
                                  f"expected ({n}, {len(desc['columns'])})")
        arrays = (self.key_blob, self.key_offsets, self.sample_start, self.member_ext,
                  self.member_offset, self.member_size, *self.labels.values())
        if any(a.ndim != 1 or a.dtype.kind not in "iu" for a in arrays):
            raise FormatError(f"{name}: index arrays are not flat integer arrays")
        if (
            n < 0
            or len(self.key_offsets) != n + 1
            or self.key_offsets[0] != 0
            or self.key_offsets[-1] != len(self.key_blob)
            or np.any(self.key_offsets[1:] < self.key_offsets[:-1])
            or (self.member_crc is not None and (self.member_crc.shape != (self.num_members,)
                                                 or self.member_crc.dtype != np.uint32))
            or any(col.shape != (n,) or col.dtype != np.int64 for col in self.labels.values())
            or self.sample_start[0] != 0
            or self.sample_start[-1] != self.num_members
            or len(self.member_ext) != self.num_members
            or len(self.member_size) != self.num_members
            or (self.num_members and (int(self.member_ext.max()) >= len(self.extensions)
                                      or int(self.member_ext.min()) < 0))
            or np.any(self.sample_start[1:] <= self.sample_start[:-1])
        ):
            raise FormatError(f"{name}: index arrays are inconsistent")

    def check_extents(self, shard_nbytes: int, name: str) -> None:
        """FormatError naming `name` if any member lies outside a shard of `shard_nbytes` bytes.

        One vectorised pass over the offsets and sizes; run when an index is opened, so that a
        damaged entry (a size of 2**40, say) is refused before anything is sized from it.
        """
        if not isinstance(shard_nbytes, int) or shard_nbytes < 0:
            raise FormatError(f"{name}: shard size {shard_nbytes!r} is not a byte count")
        if not self.num_members:
            return
        if self.member_offset.dtype.kind == "i" and self.member_offset.min() < 0 or (
                self.member_size.dtype.kind == "i" and self.member_size.min() < 0):
            raise FormatError(f"{name}: index holds negative member offsets or sizes")
        size = self.member_size.astype(np.uint64)
        limit = np.uint64(shard_nbytes)
        bad = (size > limit) | (self.member_offset.astype(np.uint64) > limit - np.minimum(size, limit))
        if bad.any():
            row = int(np.argmax(bad))
            sample = int(np.searchsorted(self.sample_start, row, side="right")) - 1
            raise FormatError(
                f"{name}: member {self.key(sample)}.{self.extensions[int(self.member_ext[row])]} "
                f"(offset {int(self.member_offset[row])}, {int(self.member_size[row])} bytes) lies "
                f"outside its shard of {shard_nbytes} bytes ({int(bad.sum())} such members); the "
                f"index is damaged: re-run gdsload convert"
            )

    # -- DALI's file ---------------------------------------------------------------------------
    def to_dali(self) -> str:
        # one pass over plain lists (not per-sample slices of the arrays: a writer builds this
        # for every shard it closes)
        exts = self.extensions
        member_ext, offsets, sizes = (self.member_ext.tolist(), self.member_offset.tolist(),
                                      self.member_size.tolist())
        start = self.sample_start.tolist()
        lines = [f"{DALI_INDEX_VERSION} {self.num_samples}"]
        for key, a, b in zip(self.keys(), start, start[1:]):
            lines.append(" ".join(f"{exts[e]} {offsets[j]} {sizes[j]} {key}.{exts[e]}"
                                  for j, e in zip(range(a, b), member_ext[a:b])))
        return "\n".join(lines) + "\n"


def _load_media(entries: object, z: object, name: str) -> dict[str, tuple[dict, np.ndarray]]:
    """The optional media tables of an index (`meta["media"]` and `media_<i>`), checked."""
    if not isinstance(entries, list):
        raise FormatError(f"{name}: index meta 'media' must be a list")
    out = {}
    for i, e in enumerate(entries):
        ok = (isinstance(e, dict) and isinstance(e.get("field"), str) and e.get("kind") in ("video", "audio")
              and isinstance(e.get("columns"), list) and isinstance(e.get("codecs"), list)
              and f"media_{i}" in z.files)
        if not ok:
            raise FormatError(f"{name}: index meta 'media' entry {i} is malformed")
        table = z[f"media_{i}"]
        if table.dtype != np.float64:
            raise FormatError(f"{name}: media_{i} is {table.dtype}, expected float64")
        codes = table[:, 0] if table.ndim == 2 and table.shape[1] else np.zeros(0)
        codes = codes[~np.isnan(codes)]
        if len(codes) and (codes.min() < 0 or codes.max() >= len(e["codecs"])):
            raise FormatError(f"{name}: media_{i} names a codec outside its table")
        values = e.get("values", {})
        if not isinstance(values, dict) or not all(isinstance(v, list) for v in values.values()):
            raise FormatError(f"{name}: index meta 'media' entry {i} has malformed 'values'")
        out[e["field"]] = ({"kind": e["kind"], "columns": e["columns"], "codecs": e["codecs"], "values": values}, table)
    return out


def parse_dali_index(text: str, *, name: str = "<dali index>") -> list[list[tuple[str, int, int, str]]]:
    """Parse a `v1.2` DALI webdataset index into per-sample `(ext, offset, size, member)` lists."""
    lines = text.splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != DALI_INDEX_VERSION:
        raise FormatError(f"{name}: not a {DALI_INDEX_VERSION} DALI index")
    out = []
    for line in lines[1:]:
        parts = line.split()
        if len(parts) % 4:
            raise FormatError(f"{name}: malformed line {line[:80]!r}")
        out.append([(parts[j], int(parts[j + 1]), int(parts[j + 2]), parts[j + 3]) for j in range(0, len(parts), 4)])
    if len(out) != int(head[1]):
        raise FormatError(f"{name}: header says {head[1]} samples, found {len(out)}")
    return out
