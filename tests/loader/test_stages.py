"""The loader as composed stages (issue "One layout a newcomer can walk"): one options object and
error type for both loaders, `set_epoch` after a drained pass (during a live one:
`tests/loader/test_live_pass.py`), per-stage times
in `stats()`, and autotune changing the loader's resources, not its configuration."""

from __future__ import annotations

import pytest
from npykit import keys, npy_dataset

from gdsload.errors import ConfigError, GdsloadError
from gdsload.loader.dataloader import DataLoader


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return str(npy_dataset(root / "src", root / "ds", num_samples=40, shape=(4,), dtype="float32", seed=1,
                           shard_size=40_000))


@pytest.mark.parametrize("kw, words", [
    ({"output": "nonsense"}, "output"),
    ({"on_error": "ignore"}, "on_error"),  # an .npy dataset: no DALI is ever built to check it
    ({"device": "gpu"}, "device"),
    ({"num_workers": -1}, "num_workers"),
    ({"shuffle": "yes"}, "shuffle"),
    ({"fields": "npy"}, "fields"),
    ({"batch_size": 0}, "batch_size"),
])
def test_invalid_options_raise_one_error_type_naming_the_option(feats, kw, words):
    with pytest.raises(ConfigError, match=words) as err:
        DataLoader(feats, device="cpu", **{"output": "numpy", **kw}) if "device" not in kw else \
            DataLoader(feats, output="numpy", **kw)
    assert isinstance(err.value, ValueError) and isinstance(err.value, GdsloadError)


def test_a_drained_pass_moves_on_and_set_epoch_after_it_applies_at_once(feats):
    dl = DataLoader(feats, batch_size=4, device="cpu", output="numpy")
    keys(dl)
    assert dl.epoch == 1 and dl.state_dict()["position"] == 0
    dl.set_epoch(7)
    assert dl.state_dict()["epoch"] == 7


def test_stats_report_per_stage_times(feats):
    dl = DataLoader(feats, batch_size=4, device="cpu", output="numpy", map=lambda s: s)
    n = sum(1 for _ in dl)
    st = dl.stats()["stages"]
    assert st["batches"] == n == 10
    assert set(st["total_s"]) == {"read", "check", "decode", "map", "copy", "wait"}
    assert st["total_s"]["read"] > 0 and st["total_s"]["map"] > 0 and st["total_s"]["decode"] == 0
    assert st["per_batch_s"]["read"] == pytest.approx(st["total_s"]["read"] / n)


def test_autotune_grows_the_resources_not_the_configuration(feats):
    dl = DataLoader(feats, batch_size=4, device="cpu", output="numpy", num_workers="auto")
    it = iter(dl)
    next(it)
    res = dl._resources
    res.add_worker()
    assert dl.num_workers == res.num_workers == dl._num_workers + 1  # the live value, read from Resources
    assert dl.stats()["num_workers"] == res.num_workers
    dl.close()


@pytest.mark.parametrize("kw, words", [
    ({"output": "nonsense"}, "output"),
    ({"on_error": "ignore"}, "on_error"),
    ({"device": "gpu"}, "device"),
    ({"shuffle": "yes"}, "shuffle"),
    ({"batch_size": 0}, "batch_size"),
])
def test_remote_loader_refuses_the_same_options_with_the_same_error(kw, words):
    """The same options, the same validation (`LoaderOptions`), before any connection is made."""
    pytest.importorskip("grpc")
    from gdsload.service.client import RemoteLoader

    with pytest.raises(ConfigError, match=words):
        RemoteLoader("127.0.0.1:1", dataset="feats", **{"output": "numpy", **kw})


def test_iter_batches_stops_early_without_ending_the_epoch(feats):
    """A server's stream of one striped block: `iter_batches(n)` reads n batches and no further,
    and the cursor stays mid-epoch (the next pass continues, the epoch is not counted done)."""
    full = keys(DataLoader(feats, batch_size=4, shuffle=True, seed=3, device="cpu", output="numpy"))
    dl = DataLoader(feats, batch_size=4, shuffle=True, seed=3, device="cpu", output="numpy", prefetch_factor=4)
    it = dl.iter_batches(2)
    assert len(it.batches) == 2 and not it.ends_epoch  # the readers have nothing past the block to claim
    assert keys(it) == full[:8]
    assert (dl.state_dict()["epoch"], dl.state_dict()["position"]) == (0, 8)
    rest = keys(dl.iter_batches(100))  # over the end: the epoch ends
    assert rest == full[8:]
    assert (dl.state_dict()["epoch"], dl.state_dict()["position"]) == (1, 0)
    with pytest.raises(ValueError, match="max_batches"):
        dl.iter_batches(0)
