"""Issue 50's leftover (issue 55): a server's striped stream (`iter_batches(steps=plan.BlockSteps)`)
over a mix of 10^8 samples per epoch starts and skips without listing its steps. Before,
`Epoch.skip_to` listed the stream's remaining steps ([s for s in steps if s >= first]: about
780,000 ints here, tens of MB); now the tail is a `BlockSteps` found by bisection. Measured with
tracemalloc's peak around the skip (deterministic enough: a list of the steps would be over 20 MB)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import gdsload
from gdsload import DataLoader
from gdsload.dataset.mix import Mix
from gdsload.plan.plan import BlockSteps


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy_skip")
    for name, n in (("a", 60), ("b", 40)):
        with gdsload.ShardWriter(root / name, shard_size="16KiB") as w:
            for i in range(n):
                w.write({"__key__": f"{name}{i:03d}", "x.npy": np.array([i], np.int64)})
    return root


def test_a_striped_stream_over_10_8_samples_skips_without_listing_its_steps(two):
    mix = Mix([str(two / "a"), str(two / "b")], weights=[0.5, 0.5], samples_per_epoch=10**8)
    lo = DataLoader(mix, batch_size=64, shuffle=True, seed=1, order=2, decode=False, output="numpy",
                    device="cpu", num_workers=2, fields=["__key__", "x.npy"])
    n = len(lo)
    steps = BlockSteps(0, n, 2, 2)  # every other block of 2 steps: half the epoch, ~780,000 steps
    assert len(steps) > 700_000
    it = lo.iter_batches(steps=steps)
    first = next(it)
    assert list(first[0]) == _keys(lo.plan.batch(0, 0))
    gc.collect()
    tracemalloc.start()
    try:
        lo.skip(1_000_000)  # global steps: to step 1,000,001, inside the stream's blocks
        after = next(it)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = min(s for s in (steps[i] for i in range(500_000, 500_002)) if s >= 1_000_001)
    assert list(after[0]) == _keys(lo.plan.batch(0, want))
    assert peak < 8 * 2**20, peak  # a list of the remaining steps alone: > 20 MB
    it.close()
    lo.close()


def _keys(ids):
    return [f"a{i:03d}" if i < 60 else f"b{i - 60:03d}" for i in ids.tolist()]
