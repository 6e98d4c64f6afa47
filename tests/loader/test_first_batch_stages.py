"""`stats()["first_batch"]` (issue 55): the time from the constructor to the first batch, split
by stage on the first batch's own path (open, plan, index, setup, pipeline_build, first_read,
first_decode; `gdsload.loader.stats.FirstBatch`). Values only: present, non-negative, adding up to
at most the total; no timing is asserted. Real DALI CPU pipelines over real shards."""

from __future__ import annotations

import pytest

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.loader.dataloader import DataLoader
from gdsload.loader.stats import FIRST_STAGES
from gdsload.sampledata import make_image_folder

EVAL = dict(train=False, size=32, resize=36)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_batch")
    make_image_folder(root / "src", num_images=12, num_classes=2, seed=7, mean_size=(64, 48), workers=1)
    convert(str(root / "src"), str(root / "ds"), ConvertOptions(workers=1, progress=False, shard_size=60_000))
    return root / "ds"


def _check(fb: dict) -> None:
    assert set(fb["stages_s"]) == set(FIRST_STAGES)
    assert fb["total_s"] > 0 and all(v >= 0 for v in fb["stages_s"].values())
    assert sum(fb["stages_s"].values()) <= fb["total_s"]
    assert fb["other_s"] == pytest.approx(fb["total_s"] - sum(fb["stages_s"].values()))


@pytest.mark.dali
@pytest.mark.parametrize("num_workers", [2, 0])
def test_stats_split_the_first_batch_by_stage(images, num_workers):
    from gdsload.decode.image import ImageTransform

    loader = DataLoader(str(images), batch_size=4, shuffle=True, seed=1, device="cpu", output="numpy",
                        num_workers=num_workers, transform=ImageTransform(**EVAL), decode_threads=1)
    assert loader.stats() == {}  # nothing before the first iter()
    it = iter(loader)
    first = next(it)
    fb = loader.stats()["first_batch"]
    _check(fb)
    s = fb["stages_s"]
    # each stage ran on this path (a string path: the constructor opened the dataset)
    assert all(s[k] > 0 for k in ("open", "plan", "index", "setup", "first_read", "first_decode")), s
    assert fb["pipeline_build_s"] > 0  # the whole build, in its thread (num_workers=0 too)
    rest = list(it)
    assert len(rest) == 2 and len(first["cls"]) == 4
    assert loader.stats()["first_batch"] == fb  # recorded once: later batches and passes add nothing
    list(loader)
    assert loader.stats()["first_batch"] == fb
    loader.close()
    assert loader.stats()["first_batch"] == fb  # kept after close


def test_a_loader_without_images_builds_no_pipeline(images):
    loader = DataLoader(str(images), batch_size=4, device="cpu", output="numpy", decode=False)
    next(iter(loader))
    fb = loader.stats()["first_batch"]
    _check(fb)
    assert fb["stages_s"]["pipeline_build"] == 0 and fb["stages_s"]["first_decode"] == 0
    assert fb["pipeline_build_s"] is None and loader._resources._decoder is None
    loader.close()
