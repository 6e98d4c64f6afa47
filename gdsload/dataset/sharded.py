"""Shard reader: random access to any sample through the index, streaming, integrity checks.

Opening a dataset reads `manifest.json` only; a shard's index is loaded on first access to that
shard and cached. `sample(i)` costs one positioned read (`pread`) spanning the sample's adjacent
members; nothing scans a tar. Paths may be local folders or fsspec URLs (`s3://…`, `file://…`,
`http(s)://…`); local paths use `os.pread` on cached file descriptors.

Thread-safety: `sample()` and `read_extent()` may be called from many threads at once (pread does
not share a file position); `close()` must not race with them.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import tarfile
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gdsload.errors import CorruptDataError, FormatError, StorageError
from gdsload.format import manifest as mf
from gdsload.format import npy
from gdsload.format.index import ShardIndex, parse_dali_index, split_name
from gdsload.format.labels import parse_label
from gdsload.io import is_remote, local_path
from gdsload.io.store import FsspecStore, load_manifest, open_store
from gdsload.format.tar import ALIGN, ALIGN_MIN_NBYTES


class ShardedDataset:
    """A converted dataset: `len()`, `sample(i)`, `iter_samples()`, `verify()`.

    `meta_dir` (a dataset at a URL read through a shard cache): the cache folder, where the
    shard cache (`gdsload.io.cache`) keeps a copy of the manifest (`manifests/<hash of the
    URL>.json`, `manifest_bytes`) and of the index of every shard it holds (`<shard SHA-256>.idx`,
    `index_copy`), counted in its limit, so a job restarted while the store is down still opens
    the dataset: the manifest is read from the store whenever it answers, the copy is used only
    when the store cannot be reached (`offline` is then True, with a warning); indexes are taken
    from the folder first (an index belongs to its shard's bytes, named by their hash), and
    checked against the manifest as ones read from the store are. Nothing here writes there
    (a damaged index copy is removed: `index`).
    """

    def __init__(self, root: str | os.PathLike[str], *, version: int | None = None,
                 meta_dir: str | os.PathLike[str] | None = None):
        """`version`: read the dataset as it was at that manifest version (its first shards; see
        `gdsload.format.manifest.at_version`); default: the newest."""
        self.remote = is_remote(str(root))  # a URL, read through fsspec (`gdsload.io.is_remote`)
        self.root = str(root).rstrip("/") if self.remote else str(local_path(root))
        self._store = open_store(self.root)
        self._fs = self._store.fs if isinstance(self._store, FsspecStore) else None
        self._meta = Path(meta_dir) if meta_dir is not None and self._fs is not None else None
        self.offline = False
        self.manifest_bytes: bytes | None = None  # as read from the store, for the cache's copy
        self.manifest = self._load_manifest()
        if version is not None:
            self.manifest = mf.at_version(self.manifest, version)
        self.shards: list[mf.ShardEntry] = self.manifest["shards"]
        self._starts = np.concatenate([[0], np.cumsum([s["samples"] for s in self.shards])]).tolist()
        self._indexes: dict[int, ShardIndex] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    # -- basics ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def __repr__(self) -> str:
        return f"ShardedDataset({self.root!r}, samples={len(self)}, shards={len(self.shards)})"

    @property
    def fields(self) -> dict[str, str]:
        return self.manifest["fields"]

    @property
    def classes(self) -> list[str] | None:
        return self.manifest.get("classes")

    def shard_path(self, i: int, which: str = "name") -> str:
        return f"{self.root}/{self.shards[i][which]}"

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample number -> (shard number, sample number within the shard)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - self._starts[s]

    def _load_manifest(self) -> dict[str, Any]:
        if self._meta is None:
            return load_manifest(self._store)
        from gdsload.io.cache import manifest_copy

        copy = manifest_copy(self._meta, self.root)
        try:
            text = self._store.read(mf.MANIFEST)
        except FileNotFoundError:
            return load_manifest(self._store)  # its own message (an interrupted conversion, ...)
        except Exception as exc:  # noqa: BLE001 - botocore's connection errors are no OSError
            if not copy.is_file():
                raise StorageError(f"cannot read {self._store.where(mf.MANIFEST)} ({type(exc).__name__}: {exc}), "
                                   f"and the cache folder {self._meta} holds no copy of it") from exc
            import warnings

            warnings.warn(f"{self._store.where(mf.MANIFEST)} cannot be read ({type(exc).__name__}: {exc}); "
                          f"using the copy in the cache folder ({copy}), read from the store before",
                          RuntimeWarning, stacklevel=3)
            self.offline = True
            return mf.parse(copy.read_text(), name=str(copy))
        manifest = mf.parse(text.decode(), name=self._store.where(mf.MANIFEST))
        self.manifest_bytes = text  # the cache writes its copy when a loader starts (counted there)
        return manifest

    def _index_bytes(self, shard: int, name: str, *, cached: bool = True) -> bytes:
        """The index file of `shard`: from the cache folder where it has one (unless `cached` is
        False), else the store (the cache keeps a copy beside the shard: `index_copy`)."""
        if self._meta is None or not cached:
            return self._read_file(name)
        try:
            return (self._meta / f"{self.shards[shard]['sha256']}.idx").read_bytes()
        except OSError:
            return self._read_file(name)

    def index_copy(self, shard: int) -> bytes | None:
        """The index of `shard` as bytes where this object has it loaded (else None): what the
        shard cache writes beside the shard's complete copy (`gdsload.io.cache.ShardCache`)."""
        idx = self._indexes.get(shard)
        return None if idx is None else idx.to_bytes()

    def index(self, shard: int) -> ShardIndex:
        idx = self._indexes.get(shard)
        if idx is None:
            name = self.shard_path(shard, "index")
            try:
                idx = self._checked_index(shard, name, self._index_bytes(shard, name))
            except FormatError:
                if self._meta is None or self.offline:
                    raise
                # the copy in the cache folder may be damaged (it is not fsynced): the store's,
                # and the copy goes (the cache writes it again from this one: `index_copy`)
                (self._meta / f"{self.shards[shard]['sha256']}.idx").unlink(missing_ok=True)
                idx = self._checked_index(shard, name, self._index_bytes(shard, name, cached=False))
            self._indexes[shard] = idx
        return idx

    def _checked_index(self, shard: int, name: str, data: bytes) -> ShardIndex:
        idx = ShardIndex.from_bytes(data, name=name)
        if idx.num_samples != self.shards[shard]["samples"]:
            raise FormatError(
                f"{name}: index lists {idx.num_samples} samples, manifest says "
                f"{self.shards[shard]['samples']}"
            )
        idx.check_extents(self.shards[shard]["bytes"], name)
        return idx

    def load_indexes(self, shards: Iterable[int], threads: int = 4) -> list[Future]:
        """Start loading the indexes of `shards` not loaded yet, `threads` requests at a time, and
        return at once (a future per index): at a URL each index is a request, and a reader that
        meets a shard first would otherwise wait for it in line. A failure stays in its future;
        `index()` raises it again, in context, where the shard is read."""
        todo = [s for s in dict.fromkeys(int(s) for s in shards) if s not in self._indexes]
        if not todo:
            return []
        pool = ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="gdsload-index")
        futures = [pool.submit(self.index, s) for s in todo]
        pool.shutdown(wait=False)  # its threads end with the last index
        return futures

    def stored_sizes(self) -> list[int | None]:
        """Every shard file's size in storage now (None: missing): a stat per shard locally, one
        listing of the dataset folder at a URL (not one request per shard)."""
        if self._fs is None:
            return [self._store.size(s["name"]) for s in self.shards]
        if self.offline:  # the store is down: the cache checks each shard's SHA-256 as it fetches
            return [s["bytes"] for s in self.shards]
        self._fs.invalidate_cache(self.root)
        listed = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in self._fs.ls(self.root, detail=True)}
        return [int(e["size"]) if (e := listed.get(s["name"])) and e.get("type") == "file" else None
                for s in self.shards]

    # -- raw I/O -------------------------------------------------------------------------------
    def _read_file(self, path: str) -> bytes:
        try:
            return self._fs.cat_file(path) if self._fs is not None else Path(path).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except Exception as exc:  # noqa: BLE001 - botocore's connection errors are no OSError
            raise StorageError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:
                fd = self._fds.get(shard)
                if fd is None:
                    path = self.shard_path(shard)
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as exc:
                        raise StorageError(f"cannot open shard {path}: {exc.strerror}") from exc
                    self._fds[shard] = fd
        return fd

    def local_fd(self, shard: int) -> int | None:
        """The open descriptor of shard `shard` when the dataset is in a local folder (None for an
        object store), owned by this object (closed with it): for `os.pread` and `os.sendfile` at
        explicit offsets from any thread."""
        return None if self._fs is not None else self._fd(shard)

    def _cached_extent(self, shard: int, offset: int, nbytes: int) -> bytes | None:
        """The bytes from the shard cache's complete copy of `shard` (named by its SHA-256, put
        there only once verified) where the cache folder has one; None otherwise."""
        if self._meta is None:
            return None
        try:
            fd = os.open(self._meta / f"{self.shards[shard]['sha256']}.tar", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)

    def read_extent(self, shard: int, offset: int, nbytes: int) -> bytes:
        """Bytes `[offset, offset + nbytes)` of a shard; a short read is a `CorruptDataError`, a
        failed one a `StorageError`."""
        try:
            if self._fs is not None and (data := self._cached_extent(shard, offset, nbytes)) is not None:
                pass
            elif self._fs is not None:
                data = self._fs.cat_file(self.shard_path(shard), start=offset, end=offset + nbytes)
            else:
                data = os.pread(self._fd(shard), nbytes, offset)
        except OSError as exc:
            raise StorageError(f"reading {self.shard_path(shard)} at offset {offset} failed: "
                               f"{exc.strerror or exc}") from exc
        except Exception as exc:  # noqa: BLE001 - botocore's connection errors are no OSError
            raise StorageError(f"reading {self.shard_path(shard)} at offset {offset} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        if len(data) != nbytes:
            raise CorruptDataError(
                f"{self.shard_path(shard)}: truncated (wanted {nbytes} bytes at offset {offset}, "
                f"got {len(data)})"
            )
        return data

    # -- samples -------------------------------------------------------------------------------
    def sample_in_shard(self, shard: int, j: int) -> dict[str, Any]:
        idx = self.index(shard)
        members = idx.members(j)
        lo = members[0][1]
        hi = max(o + s for _, o, s in members)
        blob = memoryview(self.read_extent(shard, lo, hi - lo))
        out: dict[str, Any] = {"__key__": idx.key(j), "__shard__": self.shards[shard]["name"]}
        for ext, o, s in members:
            out[ext] = bytes(blob[o - lo : o - lo + s])
        return out

    def sample(self, i: int) -> dict[str, Any]:
        """Sample `i` (global order of the dataset) as `{"__key__": ..., ext: bytes, ...}`."""
        return self.sample_in_shard(*self.locate(i))

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.sample(i)

    def iter_samples(self, shards: list[int] | None = None) -> Iterator[dict[str, Any]]:
        """Stream samples in storage order (all shards, or the given ones)."""
        for s in range(len(self.shards)) if shards is None else shards:
            for j in range(self.shards[s]["samples"]):
                yield self.sample_in_shard(s, j)

    def keys(self) -> list[str]:
        return [k for s in range(len(self.shards)) for k in self.index(s).keys()]

    # -- summaries -----------------------------------------------------------------------------
    def alignment(self) -> dict[str, int]:
        """Payloads of 4 KiB or more, how many start 4096-aligned, and the smallest ones."""
        big = aligned = small = 0
        for s in range(len(self.shards)):
            idx = self.index(s)
            mask = idx.member_size >= ALIGN_MIN_NBYTES
            big += int(mask.sum())
            aligned += int((idx.member_offset[mask] % ALIGN == 0).sum())
            small += int((~mask).sum())
        return {"payloads_4k_or_more": big, "aligned": aligned, "smaller_payloads": small}

    def class_histogram(self, field: str = "cls") -> Counter[int]:
        """Label counts: from the index's label column, or (older indexes) the `.cls` members."""
        hist: Counter[int] = Counter()
        for s in range(len(self.shards)):
            idx = self.index(s)
            col = idx.labels.get(field)
            for j in range(idx.num_samples):
                for ext, o, n in idx.members(j):
                    if ext != field:
                        continue
                    if col is not None:
                        hist[int(col[j])] += 1
                        continue
                    try:
                        hist[parse_label(self.read_extent(s, o, n))] += 1
                    except FormatError as exc:
                        raise FormatError(f"{self.shards[s]['name']}: sample {idx.key(j)!r}: {exc}") from None
        return hist

    # -- integrity -----------------------------------------------------------------------------
    def verify(self, *, hashes: bool = True) -> dict[str, list[str]]:
        """Check every shard, and that the folder holds no shard files the manifest does not list;
        returns `{file name: [problem, ...]}` for the bad shards and those files only."""
        bad: dict[str, list[str]] = {}
        for s, entry in enumerate(self.shards):
            problems = self._verify_shard(s, entry, hashes=hashes)
            if problems:
                bad[entry["name"]] = problems
        bad.update(self.unlisted())
        return bad

    def unlisted(self) -> dict[str, list[str]]:
        """Shard, index and temporary files in the dataset folder that the manifest does not
        list (what a concurrent or interrupted conversion leaves): a reader that globs `*.tar`
        would read the samples of stray shards twice, and temporaries take space."""
        listed = {e[k] for e in self.shards for k in ("name", "index", "dali_index")}
        out: dict[str, list[str]] = {}
        for name in sorted(self._store.list()):
            if name in listed:
                continue
            if name.startswith(".") and ".tmp-" in name:
                out[name] = ["unfinished temporary file of a conversion, not part of the dataset (remove it)"]
            elif name.endswith((".tar", ".idx")):
                out[name] = [f"not listed in {mf.MANIFEST}: a reader that globs the folder would read it "
                             f"(left by another or an interrupted conversion?); remove it, or convert again"]
        return out

    def _open(self, path: str) -> BinaryIO:
        return self._fs.open(path, "rb") if self._fs is not None else open(path, "rb")

    def _verify_shard(self, s: int, entry: mf.ShardEntry, *, hashes: bool) -> list[str]:
        """Size, hash, index against the tar, alignment, DALI index. At a URL the shard is read
        twice (one stream for the hash, one pass over the tar headers)."""
        path = self.shard_path(s)
        size = self._store.size(entry["name"])
        if size is None:
            return [f"missing file {path}"]
        problems = []
        if size != entry["bytes"]:
            problems.append(f"size is {size} bytes, manifest says {entry['bytes']}")
        if hashes:
            h = hashlib.sha256()
            with self._open(path) as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            if h.hexdigest() != entry["sha256"]:
                problems.append("sha256 differs from the manifest")
        try:
            idx = self.index(s)
        except (FormatError, StorageError) as exc:
            return problems + [str(exc)]
        # index against the tar as Python's tarfile parses it
        expected = []
        for j in range(idx.num_samples):
            key = idx.key(j)
            expected += [(f"{key}.{e}", o, n) for e, o, n in idx.members(j)]
        try:
            with self._open(path) as f, tarfile.open(fileobj=f, mode="r:") as tf:
                found = [(m.name, m.offset_data, m.size) for m in tf if m.isreg()]
        except (tarfile.TarError, OSError, EOFError) as exc:
            return problems + [f"tar does not parse: {exc}"]
        if found != expected:
            diff = next(((a, b) for a, b in zip(found, expected) if a != b), None)
            problems.append(
                f"index does not match the tar ({len(found)} members in tar, {len(expected)} in "
                f"index; first difference: tar {diff[0] if diff else None} vs index {diff[1] if diff else None})"
            )
        for name, off, n in expected:
            if n >= ALIGN_MIN_NBYTES and off % ALIGN:
                problems.append(f"{name}: payload at offset {off} is not {ALIGN}-aligned")
                break
            if split_name(name)[1] == "npy" and n >= ALIGN_MIN_NBYTES:
                try:
                    _, _, _, data_off = npy.parse_header(self.read_extent(s, off, min(n, 2 * ALIGN)))
                except FormatError as exc:
                    problems.append(f"{name}: {exc}")
                    break
                if (off + data_off) % ALIGN:
                    problems.append(f"{name}: array data is not {ALIGN}-aligned")
                    break
        dali_path = self.shard_path(s, "dali_index")
        try:
            dali = self._read_file(dali_path).decode()
            parse_dali_index(dali, name=dali_path)
            if dali != idx.to_dali():
                problems.append(f"{entry['dali_index']} does not match the index")
        except (OSError, FormatError, StorageError, ValueError) as exc:
            problems.append(f"DALI index: {exc}")
        return problems

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "ShardedDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def open_dataset(root: str | os.PathLike[str]) -> ShardedDataset:
    """Open a converted dataset by path or URL."""
    return ShardedDataset(root)
