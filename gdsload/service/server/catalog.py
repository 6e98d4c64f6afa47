"""The datasets a server serves: found below its roots, opened once, shared by every stream.

A dataset is a folder holding a `manifest.json`; its name is its path relative to the root it was
found under ("train", "imagenet/val"), or the folder's own name when a root is itself a dataset.
Hidden folders (a name starting with ".") are not searched. Two datasets of the same name under
different roots are refused at start-up, naming both paths.

What is shared between consumers of one dataset (thread-safe):
* the opened `gdsload.Dataset`: manifest, shard indexes (loaded once, on first use), the shard
  file descriptors used for index and header reads, the dataset id;
* the per-field upper bounds of sample sizes (the manifest's, else the indexes'), which each
  stream's `BatchLayout` reads to check requests against `max_batch_bytes`;
* the epoch order: `gdsload.plan.plan` caches the last few (dataset, seed, epoch) orders, so N ranks of
  one job compute the permutation once;
* the page cache: every stream reads the same shard files, so one job's ranks, which read
  disjoint samples of the same few open shards (the shuffle window), hit the same cached pages.
Per stream: a `DataLoader` with its reader threads, I/O backend and ring (bounded memory:
`workers * prefetch` batches), and its DALI pipeline when decoding.

A root may also be the URL of one dataset (`s3://bucket/train`): its name is the URL's last part,
and it is read through the node's shard cache (`gdsload.io.cache`, `cache_dir` and
`cache_limit` as for `gdsload.Dataset`; `cache_dir=False` reads byte ranges), shared by every
stream and by any other process using the same folder.

Names are rescanned (at most once every `rescan_s`) when a name is not found, so datasets
converted after the server started appear without a restart; a dataset whose manifest changed
(rewritten with --overwrite, or appended to) is reopened. After an append the versions before it
stay served: a request names the version it planned with by its dataset id, and gets that
version (`Catalog.dataset`), as a local `Dataset` keeps reading the version it opened.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gdsload.errors import GdsloadError
from gdsload.format.manifest import MANIFEST
from gdsload.loader.dataloader import Dataset
from gdsload.service.protocol.status import BadRequest, UnknownDataset, shown


@dataclass
class _Entry:
    path: Path | str  # a folder, or the URL of a dataset
    stamp: tuple  # (mtime_ns or ETag, size) of manifest.json when opened
    dataset: Dataset
    versions: dict[str, Dataset] = field(default_factory=dict)  # earlier versions asked for, by id


def find_datasets(roots: Sequence[str | os.PathLike[str]]) -> dict[str, Path | str]:
    """Name -> folder (or URL) of every dataset below `roots` (see the module docstring)."""
    from gdsload.io.store import is_remote

    found: dict[str, Path | str] = {}

    def add(name: str, path: Path) -> None:
        if name in found and found[name] != path:
            raise GdsloadError(
                f"two datasets are named {name!r}: {found[name]} and {path}; serve them from one root "
                "each in different sub-folders, or rename one"
            )
        found[name] = path

    for root in roots:
        if is_remote(str(root)):  # the URL of one dataset
            url = str(root).rstrip("/")
            add(url.rsplit("/", 1)[-1], url)
            continue
        root = Path(root).resolve()
        if not root.is_dir():
            raise GdsloadError(f"dataset root {root} is not a folder")
        if (root / MANIFEST).is_file():
            add(root.name, root)
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if MANIFEST in filenames and Path(dirpath) != root:
                add(Path(dirpath).relative_to(root).as_posix(), Path(dirpath))
                dirnames[:] = []  # a dataset's own folder holds shards, not datasets
    return found


def _stamp(path: Path | str) -> tuple:
    if isinstance(path, str):  # a URL: the object's ETag (or modification time) and size
        from gdsload.io.store import FsspecStore

        store = FsspecStore(path)
        where = f"{store.path}/{MANIFEST}"
        store.fs.invalidate_cache(where)  # the object as it is now, not as fsspec listed it
        info = store.fs.info(where)  # FileNotFoundError: an OSError, as below
        return str(info.get("ETag") or info.get("LastModified") or info.get("mtime")), info.get("size")
    st = (path / MANIFEST).stat()
    return st.st_mtime_ns, st.st_size


class Catalog:
    """Thread-safe name -> shared `Dataset`. Raises `UnknownDataset` naming the name and the
    served ones."""

    def __init__(self, roots: Sequence[str | os.PathLike[str]], *, rescan_s: float = 2.0,
                 cache_dir: str | os.PathLike[str] | bool | None = None, cache_limit: int | str = "50GB"):
        if not roots:
            raise GdsloadError("give at least one dataset root")
        self.roots = [str(r) for r in roots]
        self.cache_dir, self.cache_limit = cache_dir, cache_limit  # for datasets at a URL
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._paths = find_datasets(self.roots)
        self._scanned = time.monotonic()
        self._open: dict[str, _Entry] = {}

    def names(self, *, rescan: bool = False) -> list[str]:
        if rescan:
            self._rescan(force=True)
        with self._lock:
            return sorted(self._paths)

    def _rescan(self, *, force: bool = False) -> None:
        with self._lock:
            if not force and time.monotonic() - self._scanned < self.rescan_s:
                return
            self._scanned = time.monotonic()
        paths = find_datasets(self.roots)
        with self._lock:
            self._paths = paths

    def _entry(self, name: str) -> _Entry:
        if not name:
            raise BadRequest("the request names no dataset; ListDatasets gives the served names")
        with self._lock:
            path = self._paths.get(name)
        if path is None:
            self._rescan()
            with self._lock:
                path = self._paths.get(name)
                known = sorted(self._paths)
        if path is None:
            served = ", ".join(repr(n) for n in known[:20]) + (" ..." if len(known) > 20 else "")
            raise UnknownDataset(f"unknown dataset {shown(name)}; this server serves: {served or 'nothing'}")
        try:
            stamp = _stamp(path)
        except OSError:
            raise UnknownDataset(f"dataset {name!r} ({path}) has no {MANIFEST} any more") from None
        with self._lock:
            entry = self._open.get(name)
            if entry is not None and entry.stamp == stamp and entry.path == path:
                return entry
        dataset = Dataset(str(path), cache_dir=self.cache_dir, cache_limit=self.cache_limit)  # outside
        # the lock: reads the manifest
        entry = _Entry(path, stamp, dataset)
        with self._lock:
            current = self._open.get(name)
            if current is not None and current.stamp == stamp and current.path == path:
                return current
            self._open[name] = entry
        return entry

    def dataset(self, name: str, fields: Sequence[str] = (), dataset_id: str = "") -> Dataset:
        """The shared dataset, or a view of it limited to `fields` (sharing its shards).

        `dataset_id`: the version a request names (`BatchRequest.dataset_id`, what its client
        planned with): when it is an earlier version of this dataset (shards appended since), that
        version, opened once and shared (an append never rewrites its shards), so a reader that
        started on it finishes its epoch on it, and a state saved on it resumes on it; any other
        id gives the current version (the caller refuses a mismatch).

        ``NAME#documents`` (`gdsload.dataset.documents.DOCUMENTS_SUFFIX`): the documents view of
        token dataset NAME (one sample per document; issue 51), opened once per version."""
        from gdsload.dataset.documents import DOCUMENTS_SUFFIX

        if name.endswith(DOCUMENTS_SUFFIX) and len(name) > len(DOCUMENTS_SUFFIX):
            return self._documents(name[: -len(DOCUMENTS_SUFFIX)], fields, dataset_id)
        entry = self._entry(name)
        base = self._version(entry, dataset_id) if dataset_id else entry.dataset
        if not fields:
            return base
        have = base.shards.fields
        unknown = [f for f in fields if f not in have]
        if unknown:
            raise BadRequest(f"BatchRequest.fields {shown(unknown)} are not in dataset {name!r} "
                             f"(it has {sorted(have)})")
        if len(set(fields)) != len(fields):
            raise BadRequest(f"BatchRequest.fields {shown(list(fields))} name a field twice")
        view = copy.copy(base)  # shares .shards (manifest, indexes, descriptors)
        view.fields = list(fields)
        return view

    def _documents(self, name: str, fields: Sequence[str], dataset_id: str) -> Dataset:
        from gdsload.dataset.documents import FIELD, DocumentsDataset
        from gdsload.errors import FormatError

        base = self.dataset(name, (), dataset_id)
        with self._lock:
            views = self.__dict__.setdefault("_views", {})
            view = views.get(id(base))
        if view is None or view[0] is not base:
            try:
                made = DocumentsDataset(base)
            except FormatError as exc:
                raise BadRequest(f"{name}#documents: {exc}") from None
            with self._lock:
                view = views.setdefault(id(base), (base, made))
        unknown = [f for f in fields if f != FIELD]
        if unknown:
            raise BadRequest(f"BatchRequest.fields {shown(unknown)} are not in {name}#documents (it has "
                             f"['{FIELD}'])")
        return view[1]

    def _version(self, entry: _Entry, dataset_id: str) -> Dataset:
        """The version of `entry`'s dataset whose id is `dataset_id`, else the current one."""
        current = entry.dataset
        if dataset_id == current.dataset_id or dataset_id not in dict(current.earlier):
            return current
        with self._lock:
            opened = entry.versions.get(dataset_id)
        if opened is not None:
            return opened
        from gdsload.format import manifest as mf

        manifest = current.shards.manifest
        number = next(v["version"] for v in mf.versions(manifest)
                      if mf.dataset_id(manifest["shards"][: v["shards"]]) == dataset_id)
        opened = Dataset(str(entry.path), cache_dir=self.cache_dir, cache_limit=self.cache_limit, version=number)
        with self._lock:
            return entry.versions.setdefault(dataset_id, opened)
