"""torch DataLoader arguments people bring (issue 52 item 2): what has a meaning here is accepted
(`num_workers=0`, `persistent_workers`, `generator`, `worker_init_fn` for process workers), the
rest refused with a `ConfigError` naming the gdsload way (`sampler`, `batch_sampler`); class
names on the dataset (`Dataset.classes`)."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import gdsload
from gdsload.errors import ConfigError
from gdsload.loader.dataloader import DataLoader

N, BATCH = 40, 4

_INIT: list[int] = []  # in a worker process: the ids worker_init_fn was called with


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    """N samples whose `npy` row is their index (a batch's rows name its keys), 3 named classes."""
    path = tmp_path_factory.mktemp("habits") / "ds"
    with gdsload.ShardWriter(str(path), shard_size="48KiB", classes=["cat", "dog", "fish"]) as w:
        for i in range(N):
            w.write({"__key__": f"{i:04d}", "npy": np.full(4, i, np.float32), "cls": i % 3})
    return str(path)


def make(path: str, **kw) -> DataLoader:
    return DataLoader(path, **{"batch_size": BATCH, "shuffle": True, "seed": 5, "device": "cpu",
                               "output": "numpy", **kw})


def epoch(lo: DataLoader) -> list[str]:
    out = []
    for b in lo:
        assert [int(k) for k in b["__key__"]] == b["npy"][:, 0].astype(int).tolist()
        out += b["__key__"]
    return out


# -- num_workers=0 -------------------------------------------------------------------------------
def test_num_workers_0_reads_in_the_loops_thread(rows):
    """As torch's `num_workers=0` reads in the main process: no reader thread is started, each
    batch is read when `next()` asks for it; the same batches, epochs and resume as with threads.
    Before: `ConfigError: num_workers must be >= 1`."""
    ref = make(rows, num_workers=2)
    want = [epoch(ref), epoch(ref)]
    ref.close()
    lo = make(rows, num_workers=0)
    before = {t.ident for t in threading.enumerate()}
    got = []
    for b in lo:
        assert {t.ident for t in threading.enumerate()} <= before  # no thread of the loader's
        got += b["__key__"]
    assert got == want[0] and lo.epoch == 1
    assert epoch(lo) == want[1]
    assert lo.stats()["num_workers"] == 0
    it = iter(lo)  # epoch 2: stop after 3 batches, resume elsewhere
    for _ in range(3):
        next(it)
    state = lo.state_dict()
    lo.close()
    other = make(rows, num_workers=0)
    other.load_state_dict(state)
    ref = make(rows, num_workers=2)
    ref.set_epoch(2)
    assert epoch(other) == epoch(ref)[3 * BATCH:]
    other.close()
    ref.close()


def test_num_workers_0_with_prefetch_factor_is_refused(rows):
    with pytest.raises(ConfigError, match="prefetch_factor needs reader threads"):
        make(rows, num_workers=0, prefetch_factor=2)
    with pytest.raises(ConfigError, match="num_workers must be >= 0"):
        make(rows, num_workers=-1)


def tag_pid(sample: dict) -> dict:
    return {**sample, "pid": os.getpid(), "init": _INIT[-1] if _INIT else -1}


def remember_init(marker_dir: str, worker_id: int) -> None:
    _INIT.append(worker_id)
    Path(marker_dir, f"init-{worker_id}-{os.getpid()}").touch()


def test_num_workers_0_runs_process_mode_map_in_the_loops_process(rows):
    lo = make(rows, num_workers=0, map=tag_pid, worker_mode="process")
    pids = {int(p) for b in lo for p in b["pid"]}
    assert pids == {os.getpid()}


# -- worker_init_fn ------------------------------------------------------------------------------
def test_worker_init_fn_runs_in_each_worker_process_before_its_first_batch(rows, tmp_path):
    init = functools.partial(remember_init, str(tmp_path))
    lo = make(rows, num_workers=2, map=tag_pid, worker_mode="process", worker_init_fn=init)
    seen = [(int(p), int(i)) for b in lo for p, i in zip(b["pid"], b["init"])]
    lo.close()
    assert all(pid != os.getpid() for pid, _ in seen)
    markers = {(int(m.name.split("-")[2]), int(m.name.split("-")[1])) for m in tmp_path.iterdir()}
    assert {wid for _, wid in markers} == {0, 1}  # one call per worker, with its index
    assert set(seen) <= markers  # every batch was mapped after its worker's init, with that id


def test_worker_init_fn_is_for_process_workers_and_must_pickle(rows, tmp_path):
    init = functools.partial(remember_init, str(tmp_path))
    with pytest.raises(ConfigError, match="worker_init_fn runs in worker processes"):
        make(rows, worker_init_fn=init)
    with pytest.raises(ConfigError, match="picklable"):
        make(rows, map=tag_pid, worker_mode="process", worker_init_fn=lambda i: None)
    with pytest.raises(ConfigError, match="callable"):
        make(rows, map=tag_pid, worker_mode="process", worker_init_fn=3)


# -- generator, persistent_workers ---------------------------------------------------------------
def test_generator_is_the_seeds_source(rows):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1234)
    draw = torch.Generator().manual_seed(1234)
    lo = make(rows, seed=None, generator=g)
    assert lo.state_dict()["seed"] == 1234
    assert epoch(lo) == epoch(make(rows, seed=1234))
    assert torch.rand(3, generator=g).tolist() == torch.rand(3, generator=draw).tolist()  # not advanced
    other = make(rows, seed=None, generator=torch.Generator().manual_seed(1234))
    it = iter(lo)
    next(it)
    other.load_state_dict(lo.state_dict())  # a resumed run seeded the same way finds the seed again
    lo.close()
    other.close()
    with pytest.raises(ConfigError, match="seed= or generator="):
        make(rows, seed=3, generator=g)
    with pytest.raises(ConfigError, match="torch.Generator"):
        make(rows, seed=None, generator=np.random.default_rng(1))


def test_seed_defaults_to_0(rows):
    assert DataLoader(rows, device="cpu", output="numpy").state_dict()["seed"] == 0


def test_persistent_workers_is_accepted(rows):
    want = epoch(make(rows))
    assert epoch(make(rows, persistent_workers=True)) == want
    assert epoch(make(rows, persistent_workers=True, num_workers=2, map=tag_pid, worker_mode="process")) == want
    with pytest.raises(ConfigError, match="persistent_workers must be True or False"):
        make(rows, persistent_workers="yes")


# -- refused, naming the gdsload way -------------------------------------------------------------
@pytest.mark.parametrize("name, words", [
    ("sampler", r"shuffle= and seed=.*rank=/world_size=.*gdsload\.Mix"),
    ("batch_sampler", r"batch_size= and drop_last=.*gdsload\.Mix"),
])
def test_samplers_are_refused_naming_the_gdsload_way(rows, name, words):
    torch = pytest.importorskip("torch")
    sampler = torch.utils.data.RandomSampler(range(N))
    if name == "batch_sampler":
        sampler = torch.utils.data.BatchSampler(sampler, BATCH, drop_last=False)
    with pytest.raises(ConfigError, match=words) as err:
        make(rows, **{name: sampler})
    assert isinstance(err.value, ValueError) and not isinstance(err.value, TypeError)


def test_a_loader_has_no_sampler_and_says_why(rows):
    lo = make(rows)
    assert getattr(lo, "sampler", None) is None and not hasattr(lo, "sampler")
    with pytest.raises(AttributeError, match="get_resumed_dataloader"):
        lo.sampler


# -- class names ---------------------------------------------------------------------------------
def test_class_names_are_on_the_dataset(rows, tmp_path):
    ds = gdsload.Dataset(rows)
    assert ds.classes == ["cat", "dog", "fish"]
    lo = make(ds)
    assert lo.dataset.classes == ["cat", "dog", "fish"]
    b = next(iter(lo))
    assert [ds.classes[c] for c in b["cls"]] == [["cat", "dog", "fish"][int(k) % 3] for k in b["__key__"]]
    lo.close()
    with gdsload.ShardWriter(str(tmp_path / "plain"), shard_size="48KiB") as w:
        w.write({"__key__": "a", "npy": np.zeros(4, np.float32)})
    assert gdsload.Dataset(str(tmp_path / "plain")).classes is None
