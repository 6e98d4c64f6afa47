"""What a `RemoteLoader` reads, as the `Source` of `gdsload.dataset.source`: a served dataset
(`ServedDataset`) or a `gdsload.Mix` of served datasets (`ServedMix`), described by the servers'
`DatasetInfo` (asked on first use, then kept) instead of local shards.

The loader plans with it exactly as the local `DataLoader` plans with a `Dataset` or a `Mix`
(`source.make_plan(**options.plan_args())`) and never asks which kind it holds; `request_target`
is what the request names (the dataset, or the mix with the ids the client planned with). Nothing
is read on this side: `shards` is None and `parts` empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gdsload.errors import GdsloadError
from gdsload.service.protocol import mixwire
from gdsload.v1 import feed_pb2 as pb

#: `ask(name)`: the `DatasetInfo` a server has for the dataset served as `name` (`link.Link.dataset_info`).
Ask = Callable[[str], pb.DatasetInfo]


class ServedDataset:
    """One dataset served by name; `fields`: the fields the loader asks for (each must be there).

    Versions: the loader plans with the version the server serves when it first asks (or
    `version=K`, as `gdsload.Dataset(path, version=K)`: the dataset as it was at manifest version
    K, its first shards, read from the `DatasetInfo`'s manifest), and every request names that
    version by its dataset id, so an append on the server changes nothing for this loader: the
    server keeps serving the version its requests name (`gdsload.service.server.catalog`)."""

    shards = None
    parts: tuple = ()

    def __init__(self, name: str, ask: Ask, fields: Sequence[str] = (), version: int | None = None):
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise GdsloadError(f"version must be a manifest version >= 1 (`gdsload inspect` lists them) or None, "
                               f"got {version!r}")
        self.name = name
        self.ask = ask
        self.asked_fields = list(fields)
        self.version = version
        self._info: pb.DatasetInfo | None = None
        self._versioned: tuple[str, tuple[int, ...], tuple[tuple[str, int], ...]] | None = None

    def info(self, name: str | None = None) -> pb.DatasetInfo:
        """The server's `DatasetInfo` (name, id, shard sizes, fields, manifest), asked once."""
        if name not in (None, self.name):
            raise GdsloadError(f"this loader reads dataset {self.name!r}, not {name!r}")
        if self._info is None:
            self._info = self.ask(self.name)
        return self._info

    def _at_version(self) -> tuple[str, tuple[int, ...], tuple[tuple[str, int], ...]]:
        """(dataset id, shard sizes, earlier versions' (id, samples)) of the version planned with."""
        if self._versioned is None:
            from gdsload.errors import FormatError
            from gdsload.format import manifest as mf

            info = self.info()
            try:
                manifest = mf.parse(info.manifest_json, name=f"dataset {self.name!r}'s manifest")
                if self.version is not None:
                    manifest = mf.at_version(manifest, self.version)
            except FormatError as exc:
                raise GdsloadError(f"dataset {self.name!r} on the server: {exc}") from None
            shards = manifest["shards"]
            known = mf.versions(manifest)
            earlier = tuple((mf.dataset_id(shards[: v["shards"]]), v["num_samples"]) for v in known[:-1])
            sizes = tuple(int(x["samples"]) for x in shards)
            ident = mf.dataset_id(shards) if self.version is not None else info.dataset_id
            self._versioned = ident, (sizes if self.version is not None else tuple(info.shard_sizes)), earlier
        return self._versioned

    @property
    def dataset_id(self) -> str:
        return self._at_version()[0]

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return self._at_version()[1]

    @property
    def fields(self) -> list[str]:
        return list(self.info().fields)

    @property
    def names(self) -> list[str]:
        return [self.name]

    def select(self, fields: Sequence[str]) -> ServedDataset:
        return ServedDataset(self.name, self.ask, fields, self.version)

    def sources_of(self, ids: np.ndarray) -> None:
        return None  # one dataset: batches have no "__source__"

    def make_plan(self, **plan_args: Any) -> Any:
        """The `gdsload.plan.plan.Plan` of this dataset (refusing fields it does not have)."""
        from gdsload.plan.plan import Plan

        info = self.info()
        unknown = [f for f in self.asked_fields if f not in info.fields]
        if unknown:
            raise GdsloadError(f"fields {unknown} are not in dataset {self.name!r} (it has {sorted(info.fields)})")
        ident, sizes, earlier = self._at_version()
        return Plan(dataset_id=ident, shard_sizes=sizes, earlier=earlier, **plan_args)

    def request_target(self, plan: Any) -> tuple[str, pb.MixSpec | None]:
        """What `BatchRequest.dataset` / `.mix` say for it."""
        return self.name, None


class ServedMix:
    """A `gdsload.Mix` of served dataset names, resolved with the servers' `DatasetInfo`
    (`mixwire.resolve`: each dataset's id and shard sizes, the fields checked in each)."""

    shards = None
    parts: tuple = ()

    def __init__(self, mix: Any, ask: Ask, fields: Sequence[str] = ()):
        self.mix = mix
        self.ask = ask
        self.asked_fields = list(fields)
        self._spec: Any = None
        self._infos: dict[str, pb.DatasetInfo] = {}

    def info(self, name: str | None = None) -> pb.DatasetInfo:
        """The server's `DatasetInfo` of dataset `name` of the mix (asked once)."""
        if name not in self.mix.datasets:
            raise GdsloadError(f"name one of the mix's datasets {list(self.mix.datasets)}, got {name!r}")
        if name not in self._infos:
            self._infos[name] = self.ask(name)
        return self._infos[name]

    @property
    def spec(self) -> Any:
        """The mix's `gdsload.plan.mix.MixSpec` (asks the servers on first use)."""
        if self._spec is None:
            self._spec = mixwire.resolve(self.mix, self.info, self.asked_fields)
        return self._spec

    @property
    def dataset_id(self) -> str:
        return self.spec.mix_id

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return self.spec.shard_sizes

    @property
    def fields(self) -> list[str]:
        """The fields every dataset of the mix has."""
        infos = [self.info(name) for name in self.mix.datasets]
        return [f for f in infos[0].fields if all(f in i.fields for i in infos[1:])]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.spec.sources]

    def select(self, fields: Sequence[str]) -> ServedMix:
        return ServedMix(self.mix, self.ask, fields)

    def sources_of(self, ids: np.ndarray) -> list[str]:
        """The "__source__" name of each global id."""
        which = np.searchsorted(self.spec.offsets[1:], np.asarray(ids), side="right")
        names = self.names
        return [names[i] for i in which.tolist()]

    def make_plan(self, **plan_args: Any) -> Any:
        """The `gdsload.plan.mix.MixPlan` of this mix."""
        from gdsload.plan.mix import MixPlan

        spec = self.spec
        return MixPlan(dataset_id=spec.mix_id, shard_sizes=spec.shard_sizes, mix=spec, **plan_args)

    def request_target(self, plan: Any) -> tuple[str, pb.MixSpec | None]:
        return "", mixwire.to_pb(self.mix, plan.mix)


def remote_source(dataset: Any, ask: Ask, fields: Sequence[str] = (),
                  version: int | None = None) -> ServedDataset | ServedMix:
    """The source of `RemoteLoader(dataset=..., version=...)`: a served name, or a `gdsload.Mix`
    of them (whose datasets' versions are those their `Dataset`s name)."""
    if callable(getattr(dataset, "spec_with", None)):  # a Mix (as gdsload.dataset.source.open_source tells)
        if version is not None:
            raise GdsloadError("version= names a version of one served dataset; a Mix's datasets are "
                               "planned as the server serves them")
        return ServedMix(dataset, ask, fields)
    if not isinstance(dataset, str) or not dataset:
        raise GdsloadError(f"dataset must be the served dataset's name (or a gdsload.Mix of served names), "
                           f"got {dataset!r}")
    return ServedDataset(dataset, ask, fields, version)
