"""A `RemoteLoader`'s source (`gdsload.service.client.source`): a served dataset or a Mix of served
datasets is a `gdsload.dataset.source.Source`, planned the way the local `Dataset`/`Mix` is, so the
loader plans both with `source.make_plan(**options.plan_args())` and never asks which it holds."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("grpc")

from gdsload.dataset.dataset import Dataset
from gdsload.dataset.mix import Mix
from gdsload.dataset.source import Source
from gdsload.errors import GdsloadError
from gdsload.frontend.options import LoaderOptions
from gdsload.service.client import RemoteLoader
from gdsload.service.client.source import ServedDataset, ServedMix

ARGS = LoaderOptions.create(remote=True, batch_size=8, shuffle=True, seed=4, rank=1, world_size=2,
                            output="numpy").plan_args()


def steps(plan, epoch=2):
    return [np.asarray(b).tolist() for b in plan.batches(epoch, 0)]


def test_a_served_dataset_is_a_source_and_plans_as_the_local_dataset(server, roots):
    _, address = server
    lo = RemoteLoader(address, dataset="feats", output="numpy")
    src, here = lo.source, Dataset(str(roots / "feats"))
    assert isinstance(src, ServedDataset) and isinstance(src, Source)
    assert (src.dataset_id, src.shard_sizes, sorted(src.fields)) == (here.dataset_id, here.shard_sizes,
                                                                    sorted(here.fields))
    assert src.sources_of(np.arange(3)) is None and src.names == ["feats"] and src.shards is None
    assert steps(src.make_plan(**ARGS)) == steps(here.make_plan(**ARGS))
    assert lo.dataset_info().dataset_id == here.dataset_id
    with pytest.raises(GdsloadError, match="fields \\['nope'\\] are not in dataset 'feats'"):
        src.select(["nope"]).make_plan(**ARGS)
    lo.close()


def test_a_served_mix_is_a_source_and_plans_as_the_local_mix(server, roots):
    _, address = server
    kw = dict(weights=[3, 1], samples_per_epoch=120)
    lo = RemoteLoader(address, dataset=Mix(["feats", "imgs"], **kw), output="numpy", decode=False)
    src, here = lo.source, Mix([Dataset(str(roots / "feats")), Dataset(str(roots / "imgs"))], **kw)
    assert isinstance(src, ServedMix) and isinstance(src, Source)
    assert (src.dataset_id, src.shard_sizes) == (here.dataset_id, here.shard_sizes)
    assert src.names == here.names and set(src.fields) == set(here.fields)
    ids = np.array([0, 255, 256, here.spec.offsets[-1] - 1])
    assert src.sources_of(ids) == here.sources_of(ids)
    assert steps(src.make_plan(**ARGS)) == steps(here.make_plan(**ARGS))
    assert lo.dataset_info("imgs").dataset_id == Dataset(str(roots / "imgs")).dataset_id
    with pytest.raises(GdsloadError, match="name one of the mix's datasets"):
        lo.dataset_info()
    lo.close()
