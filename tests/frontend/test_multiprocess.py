"""`gdsload.DataLoader` across processes: torch DataLoader workers and a multiprocessing Pool
under fork, spawn and forkserver, a forked child iterating its parent's iterator, and what
pickling carries (configuration and cursor, never threads, rings, files or DALI pipelines).

One small image dataset (24 JPEGs, 2 classes, several shards) with a deterministic eval
transform, so that values are comparable across processes; batches of 4, so an epoch is 6.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from mpkit import METHODS, assert_no_new_children, assert_same, child_pids, numpy_batch, via_pool, via_torch

from gdsload.convert.engine import ConvertOptions, convert
from gdsload.decode.image import ImageTransform
from gdsload.errors import FormatError, GdsloadError
from gdsload.loader.dataloader import DataLoader, Dataset
from gdsload.sampledata import make_image_folder, make_npy_folder

pytestmark = [pytest.mark.dali, pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc")]

EVAL = ImageTransform(train=False, size=32, resize=36, mean=None, std=None, dtype="uint8", layout="NHWC")
SAMPLES, BATCH, TAKEN = 24, 4, 2


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp")
    make_image_folder(root / "src", num_images=SAMPLES, num_classes=2, seed=3, mean_size=(64, 48), workers=1)
    convert(str(root / "src"), str(root / "ds"), ConvertOptions(workers=1, progress=False, shard_size=40_000))
    return root / "ds"


def make_loader(path: Path, **kw) -> DataLoader:
    kw = dict(batch_size=BATCH, shuffle=True, seed=3, transform=EVAL, copy=True, device="cpu", num_workers=2,
              decode_threads=1, output="torch") | kw
    return DataLoader(Dataset(str(path)), **kw)


@pytest.fixture
def loaders(images):
    """A fresh loader, and a used one: TAKEN batches taken, its iterator left open mid-epoch (its
    producer threads are waiting on a full ring). Yields (fresh, used, used's iterator, taken)."""
    fresh, used = make_loader(images), make_loader(images)
    it = iter(used)
    taken = [next(it) for _ in range(TAKEN)]
    yield fresh, used, it, taken
    fresh.close()
    used.close()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("via", [via_torch, via_pool], ids=["torch", "pool"])
def test_workers_deliver_what_the_parent_would(loaders, method, via):
    """Before: fork hung in Ring._wait (the parent's threads are not in the child); spawn and
    forkserver failed with "cannot pickle '_thread.lock' object"."""
    fresh, used, it, taken = loaders
    before = child_pids()
    got = via([fresh, used], method)
    assert_no_new_children(before)
    # what the parent's own loaders deliver next: the fresh one its epoch 0, the used one the
    # rest of its epoch from where it stood (a pickled or forked loader carries its state_dict())
    want = list(fresh) + list(it)
    assert len(want) == SAMPLES // BATCH * 2 - TAKEN
    assert [i for i, _ in got] == list(range(len(want)))
    for (i, g), w in zip(got, want):
        assert_same(g, w, f"batch {i}")
    keys = [k for b in taken + want[SAMPLES // BATCH :] for k in b["__key__"]]
    assert sorted(keys) == sorted(k for b in want[: SAMPLES // BATCH] for k in b["__key__"])


def _reap(child) -> None:
    """Join a child; one that does not exit in time is killed (and the test fails on its exit code)."""
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()


def _drain(it, out) -> None:
    try:
        out.put([numpy_batch(b) for b in it])
    except BaseException as exc:  # reported by the parent (as text: it need not unpickle there)
        out.put(f"{type(exc).__name__}: {exc}")


def test_forked_child_continues_the_parents_iterator(loaders):
    """Before: next() on the parent's iterator in a forked child waited forever on its ring."""
    _, _, it, _ = loaders
    ctx = mp.get_context("fork")
    before = child_pids()
    out = ctx.Queue()
    child = ctx.Process(target=_drain, args=(it, out), daemon=True)
    child.start()
    try:
        got = out.get(timeout=90)
    finally:
        _reap(child)
    assert child.exitcode == 0
    assert_no_new_children(before)
    assert not isinstance(got, str), got
    want = list(it)  # the parent's iterator is untouched by the child
    assert len(got) == len(want) == SAMPLES // BATCH - TAKEN
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"batch {i}")


_HELD: list = []  # decoders a forked child inherits only through this list (no other reference)


def _decode_then_drop(jpegs, out) -> None:
    use, drop = _HELD
    _HELD.clear()
    del drop
    gc.collect()  # the parent's second pipeline is destroyed here (a segfault before)
    batch, kept = use.decode(jpegs, [f"j{i}" for i in range(len(jpegs))])  # the first one, reused
    out.put((tuple(batch.as_tensor().shape()), kept))


def test_a_forked_child_drops_and_reuses_the_parents_dali_pipelines(images):
    """Before: a torch worker forked from a process holding DALI pipelines crashed (SIGSEGV) when
    its garbage collector destroyed one of them; now the child never destroys the parent's
    pipelines, and a decoder it inherited builds its own."""
    from gdsload.decode.image import ImageDecoder

    jpegs = [np.fromfile(p, dtype=np.uint8) for p in sorted((images.parent / "src").rglob("*.jpg"))[:3]]
    for _ in range(2):
        _HELD.append(ImageDecoder(EVAL, batch_size=4, threads=1))
        _HELD[-1].decode(jpegs, ["a", "b", "c"])
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_decode_then_drop, args=(jpegs, out), daemon=True)
    child.start()
    try:
        got = out.get(timeout=90)
    finally:
        _reap(child)
        _HELD.clear()
    assert child.exitcode == 0
    assert got == ((3, 32, 32, 3), [0, 1, 2])


def test_pickle_carries_configuration_and_cursor_only(loaders, images):
    fresh, used, it, _ = loaders
    blob = pickle.dumps(used)
    assert len(blob) < 20_000  # no ring, arena or pipeline inside
    copy = pickle.loads(blob)
    assert copy.state_dict() == used.state_dict() and copy.state_dict()["position"] == TAKEN * BATCH
    assert copy._resources is None and copy.cursor.live() is None  # built on first iteration, in this process
    rest = list(copy)
    want = list(it)
    assert len(rest) == len(want)
    for i, (g, w) in enumerate(zip(rest, want)):
        assert_same(g, w, f"batch {i}")
    copy.close()
    ds = pickle.loads(pickle.dumps(fresh.dataset))
    assert (ds.path, ds.fields, len(ds), ds.dataset_id) == (fresh.dataset.path, fresh.dataset.fields,
                                                             SAMPLES, fresh.dataset.dataset_id)


def test_unpickled_dataset_refuses_a_dataset_changed_on_disk(tmp_path):
    make_npy_folder(tmp_path / "a", num_samples=8, shape=(4,), dtype="uint8", seed=1)
    make_npy_folder(tmp_path / "b", num_samples=8, shape=(4,), dtype="uint8", seed=2)
    convert(str(tmp_path / "a"), str(tmp_path / "ds"), ConvertOptions(workers=1, progress=False))
    blob = pickle.dumps(Dataset(str(tmp_path / "ds")))
    convert(str(tmp_path / "b"), str(tmp_path / "ds"), ConvertOptions(workers=1, progress=False, overwrite=True))
    ds = pickle.loads(blob)
    with pytest.raises(FormatError, match="changed since this Dataset was opened"):
        len(ds)


def test_an_iterator_does_not_pickle_but_says_what_does(loaders):
    with pytest.raises(TypeError, match="pickle the loader itself"):
        pickle.dumps(loaders[2])


def _module_level_fn(images):
    return images


def test_image_transform_pickles_unless_its_user_fn_cannot():
    t = ImageTransform(size=64, train=False, user_fn=_module_level_fn)
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.user_fn is _module_level_fn
    with pytest.raises(GdsloadError, match="user_fn .* cannot be pickled.*module level"):
        pickle.dumps(ImageTransform(user_fn=lambda images: images))


@pytest.mark.gpu
def test_a_cuda_loader_forked_after_using_cuda_is_refused_clearly(images):
    loader = make_loader(images, device="cuda")
    it = iter(loader)
    next(it)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_drain, args=(loader, out), daemon=True)
    child.start()
    try:
        got = out.get(timeout=90)
    finally:
        _reap(child)
    assert isinstance(got, str) and got.startswith("GdsloadError") and "'spawn'" in got, got
    loader.close()
    assert child.exitcode == 0
