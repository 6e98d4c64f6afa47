"""`gdsload.Dataset`: a converted dataset, opened by path or URL (the manifest only, until used)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Literal

from gdsload.errors import FormatError, GdsloadError
from gdsload.dataset.sharded import ShardedDataset
from gdsload.host.forksafe import ProcessLocal
from gdsload.dataset.verify import VerifyMode, check_mode
from gdsload.sizes import SizeError, parse_size


class Dataset(ProcessLocal):
    """A converted dataset, opened by path (or fsspec URL). Reads only the manifest until used.

    `verify`: what a loader checks while reading it, "fast" (default: shard sizes, CRC32 of the
    members staged in host memory), "full" (also `.npy` tensors) or None; see `gdsload.dataset.verify`.

    A dataset at a URL (s3://, gs://, http(s)://) is read through a local shard cache
    (`gdsload.io.cache`): whole shards are fetched ahead of the plan and evicted by it.
    `cache_dir=None` uses `$XDG_CACHE_HOME/gdsload/shards` (else `~/.cache/gdsload/shards`);
    `cache_dir=False` reads byte ranges from the store instead. `cache_limit` (bytes, or a size
    such as "50GB", "200GiB") bounds the folder. A local dataset has no cache.

    Pickles to its path, fields, `verify` and cache settings; a copy in another process (or a
    forked child) opens the dataset again on first use and refuses it if its content changed in
    between. Appends (`gdsload.ShardWriter(append=True)`) are not a change there: the copy keeps
    reading the version this Dataset opened (its first shards, which an append never rewrites).

    `version`: open the dataset as it was at that manifest version (1: as first written), e.g.
    to finish an epoch whose state was saved before an append; default: the newest.
    """

    _PROCESS_LOCAL = ("_shards",)

    def __init__(self, path: str, *, fields: Sequence[str] | None = None, verify: VerifyMode = "fast",
                 cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
                 cache_limit: int | str = "50GB", version: int | None = None):
        from gdsload.io import is_remote

        self.path = str(path)
        self.verify = check_mode(verify)
        self._start_process()
        self.cache_limit = parse_limit(cache_limit)
        if cache_dir is False or not is_remote(self.path):
            self.cache_dir: str | None = None
        elif cache_dir is None:
            from gdsload.io.cache import default_cache_dir

            self.cache_dir = str(default_cache_dir())
        else:
            self.cache_dir = str(cache_dir)
        # the cache folder also keeps the manifest and the indexes: a restart with the store down
        self._shards = ShardedDataset(path, version=version, meta_dir=self.cache_dir)
        self._id = self._content_id(self._shards)
        # every version this one extends: (its dataset id, its samples), for `Plan.earlier`
        from gdsload.format import manifest as mf

        self.version = mf.versions(self._shards.manifest)[-1]["version"]
        self.earlier = tuple((mf.dataset_id(self._shards.shards[: v["shards"]]), v["num_samples"])
                             for v in mf.versions(self._shards.manifest)[:-1])
        self.fields = list(fields) if fields else [f for f in self.shards.fields]
        unknown = [f for f in self.fields if f not in self.shards.fields and f != "__key__"]
        if unknown:
            raise GdsloadError(
                f"fields {unknown} are not in dataset {self.path} (it has {sorted(self.shards.fields)})"
            )

    def _init_process_local(self) -> None:
        self._shards = None

    @property
    def shards(self) -> ShardedDataset:
        """The open dataset of this process (its file descriptors and lock are per process)."""
        self._check_process()
        if self._shards is None:
            try:  # the version this Dataset opened: appends since then are not seen
                shards = ShardedDataset(self.path, version=self.version, meta_dir=self.cache_dir)
            except FormatError:  # rewritten (--overwrite) with fewer versions: the check below says so
                shards = ShardedDataset(self.path, meta_dir=self.cache_dir)
            if self._content_id(shards) != self._id:
                raise FormatError(
                    f"dataset {self.path} changed since this Dataset was opened (content id {self._id} "
                    f"then, {self._content_id(shards)} now): open it again"
                )
            self._shards = shards
        return self._shards

    @staticmethod
    def _content_id(shards: ShardedDataset) -> str:
        from gdsload.format.manifest import dataset_id

        return dataset_id(shards.shards)

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def dataset_id(self) -> str:
        """Identity for states: hash of the shards' content hashes, in order."""
        return self._id

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(s["samples"] for s in self.shards.shards)

    @property
    def classes(self) -> list[str] | None:
        """The class names, as torchvision's `ImageFolder.classes`: label i (a batch's `cls`) is
        `classes[i]`: the class folders' names, sorted (as `ImageFolder`), a `ClassLabel` column's
        names, a labels file's names (sorted) or the writer's `classes=`; None when there are none
        (no labels, or integer labels). Appends add new names at the end, so earlier labels keep theirs."""
        return self.shards.classes

    def __repr__(self) -> str:
        return f"gdsload.Dataset({self.path!r}, samples={len(self)}, fields={self.fields})"

    # -- the Source interface (gdsload.dataset.source) -------------------------------------------
    @property
    def parts(self) -> list["Dataset"]:
        return [self]

    @property
    def names(self) -> list[str]:
        return [PurePosixPath(self.path.rstrip("/")).name or self.path]

    def select(self, fields: Sequence[str]) -> "Dataset":
        """This dataset reading `fields` only (each must be in it)."""
        return Dataset(self.path, fields=fields, verify=self.verify, cache_dir=self.cache_dir or False,
                       cache_limit=self.cache_limit, version=self.version)

    def sources_of(self, ids) -> None:
        return None  # one dataset: batches have no "__source__"

    def make_plan(self, **plan_args):
        """The `gdsload.plan.plan.Plan` of this dataset with the loader's order options."""
        from gdsload.plan.plan import Plan

        return Plan(dataset_id=self.dataset_id, shard_sizes=self.shard_sizes, earlier=self.earlier, **plan_args)


def parse_limit(limit: int | str) -> int:
    """`cache_limit` in bytes: an int, or a size string as the CLI takes (`50GB`, `1.5GiB`)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise GdsloadError(f"cache_limit must be bytes (an int) or a size such as '50GB', got {limit!r}")
    try:
        n = parse_size(limit) if isinstance(limit, str) else limit
    except SizeError as exc:
        raise GdsloadError(f"cache_limit: {exc}") from None
    if n <= 0:
        raise GdsloadError(f"cache_limit must be positive, got {limit!r}")
    return n
