"""`gdsload.process(..., engine="ray")`: the units as Ray tasks write the same bytes as a local
pass (manifest apart from its creation time). One 2-CPU local Ray instance; skipped without Ray."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mediakit import assert_same_output

import gdsload


def test_ray_pass_equals_local(media_src: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    import numpy as np

    def stats(b):  # defined here: Ray ships it by value (a test module is not importable by its workers)
        return [{"mean.npy": f.mean(axis=(1, 2, 3)), "t.json": t.tolist()} for f, t in zip(b["frames"], b["t"])]

    kw = dict(frames=(5.0, 2), size=45, batch_size=3, shard_size="16KiB")
    gdsload.process(media_src, tmp_path / "local", stats, **kw)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        r = gdsload.process(media_src, tmp_path / "ray", stats, engine="ray", **kw)
    finally:
        ray.shutdown()
    assert r["engine"] == "ray" and r["shards"] > 3 and np.isfinite(r["media_hours"])
    assert_same_output(tmp_path / "ray", tmp_path / "local")
