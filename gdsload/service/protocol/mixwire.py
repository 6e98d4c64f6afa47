"""A `gdsload.Mix` on the wire (`BatchRequest.mix`, documented in proto/gdsload/v1/feed.proto).

Client: `resolve` turns a Mix of served names into its `MixSpec` from the servers' DatasetInfo,
and `to_pb` into the request's MixSpec message (the resolved counts' rules: weights as the client
resolved them, so both ends compute one `mix_id` and one order). Server: `open_mix` rebuilds the
Mix over the shared catalog datasets, checking each source's dataset id (the server bounds a
batch of it from its loader's layout, as any: `gdsload.service.server.estimate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any, Protocol

from gdsload.errors import GdsloadError
from gdsload.dataset.mix import Mix
from gdsload.plan.mix import MixSpec
from gdsload.service.protocol.status import BadRequest, DatasetChanged
from gdsload.v1 import feed_pb2 as pb



class Catalog(Protocol):
    """What `open_mix` needs of the server's catalog (`gdsload.service.server.catalog.Catalog`),
    so this module, shared with the client, imports nothing of the server."""

    def dataset(self, name: str, fields: list[str], dataset_id: str = "") -> Any: ...

_MIX_BY = {"sample": pb.MIX_BY_SAMPLE, "batch": pb.MIX_BY_BATCH}
_FROM_PB = {pb.MIX_BY_UNSPECIFIED: "sample", pb.MIX_BY_SAMPLE: "sample", pb.MIX_BY_BATCH: "batch"}


# -- client -----------------------------------------------------------------------------------
def resolve(mix: Mix, info: Callable[[str], pb.DatasetInfo], fields: Sequence[str]) -> MixSpec:
    """The MixSpec of a Mix of served dataset names; `info(name)` asks a server."""
    if not all(isinstance(d, str) and d for d in mix.datasets):
        raise GdsloadError("a RemoteLoader's Mix names served datasets by their names (strings), got "
                           f"{mix.datasets!r}")
    infos = [info(name) for name in mix.datasets]
    for name, i in zip(mix.datasets, infos):
        unknown = [f for f in fields if f not in i.fields]
        if unknown:
            raise GdsloadError(f"fields {unknown} are not in dataset {name!r} of the mix (it has "
                               f"{sorted(i.fields)}); a mix reads fields all its datasets have")
    return mix.spec_with([(i.dataset_id, tuple(i.shard_sizes)) for i in infos])


def to_pb(mix: Mix, spec: MixSpec) -> pb.MixSpec:
    sources = []
    for name, s in zip(mix.datasets, spec.sources):
        src = pb.MixSource(dataset=name, dataset_id=s.dataset_id, name=s.name)
        if s.weight is not None:
            src.weight = s.weight
        if s.repeat is not None:
            src.repeat = s.repeat
        if s.samples is not None:
            src.samples = s.samples
        sources.append(src)
    return pb.MixSpec(sources=sources, samples_per_epoch=spec.samples_per_epoch or 0,
                      mix_by=_MIX_BY[spec.mix_by],
                      schedule=[pb.MixPhase(tokens=at, weights=list(w)) for at, w in spec.schedule])


def schedule_of(m: pb.MixSpec) -> list[tuple[int, list[float]]]:
    """The weight schedule a MixSpec message carries (issue 51; empty: none)."""
    return [(int(p.tokens), list(p.weights)) for p in m.schedule]


# -- server -----------------------------------------------------------------------------------
def label(spec: pb.MixSpec) -> str:
    """The name a mix gets in logs and metrics: "mix:a+b" (served names only)."""
    return "mix:" + "+".join(s.dataset for s in spec.sources)


def open_mix(catalog: Catalog, req: pb.BatchRequest) -> Mix:
    """The Mix a request names, over the catalog's shared datasets (limited to `req.fields`).

    Sets `req.dataset` to the mix's `label`, which the server's logs and metrics then use.
    """
    m = req.mix
    if req.dataset:
        raise BadRequest(f"the request names both dataset {req.dataset!r} and a mix; name one "
                         "(BatchRequest.dataset must be empty with a mix)")
    if not m.sources:
        raise BadRequest("the request's mix has no datasets")
    if m.mix_by not in _FROM_PB:
        raise BadRequest(f"mix.mix_by {m.mix_by} is not one of MIX_BY_SAMPLE, MIX_BY_BATCH")
    if m.schedule:
        raise BadRequest("the request's mix has a weight schedule (MixSpec.schedule, weights by tokens "
                         "consumed): this server mixes samples; a schedule is read by gdsload.TokenLoader")
    datasets = []
    for i, s in enumerate(m.sources):
        ds = catalog.dataset(s.dataset, list(req.fields), s.dataset_id)
        if s.dataset_id and s.dataset_id != ds.dataset_id:
            raise DatasetChanged(
                f"dataset {s.dataset!r} (mix source {i}) on this server has id {ds.dataset_id}, the "
                f"client planned with {s.dataset_id}: the dataset was rewritten; start from a fresh state"
            )
        datasets.append(ds)
    srcs = m.sources

    def opt(name: str) -> list:
        return [getattr(s, name) if s.HasField(name) else None for s in srcs]

    weights = opt("weight")
    mix = Mix(datasets, weights=weights if any(w is not None for w in weights) else None,
              samples_per_epoch=m.samples_per_epoch or None, repeat=opt("repeat"), samples=opt("samples"),
              mix_by=_FROM_PB[m.mix_by],
              names=[s.name or PurePosixPath(s.dataset).name for s in srcs])
    req.dataset = label(m)
    return mix
